package scripts

import (
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestREADMEAdminExample: the admin calls `make up` prints (stack.sh
// admin-example) are the README's admin example, line for line, so that
// pasting the README's runs against the stack.
func TestREADMEAdminExample(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	out, err := exec.Command(bash, "stack.sh", "admin-example").Output()
	if err != nil {
		t.Fatalf("stack.sh admin-example: %v", err)
	}
	example := string(out)
	if !strings.Contains(example, "/admin/rules/") || !strings.Contains(example, ".stack/admin-token") {
		t.Fatalf("stack.sh admin-example prints no admin call with the stack's token:\n%s", example)
	}
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), "```sh\n"+example+"```\n") {
		t.Errorf("README.md has no sh block that is exactly what make up prints:\n%s", example)
	}
}
