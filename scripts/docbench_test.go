package scripts

import (
	"flag"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
)

// docbenchRun runs every benchmark the docs quote once, at -benchtime 1x:
// scripts/test.sh's last phase passes it, so that `make test` notices a
// quoted figure whose command no longer runs (as one did when NATS was
// locked with authorization).
var docbenchRun = flag.Bool("docbench.run", false, "also run every benchmark command the docs quote, at -benchtime 1x")

// docFiles are the files whose quoted `go test -bench` commands are held
// to the code: the READMEs, docs/ and the deploy manifests' comments.
func docFiles(t *testing.T) []string {
	t.Helper()
	files := []string{"../README.md", "../deploy/README.md"}
	for _, root := range []string{"../docs", "../deploy"} {
		err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
			if err != nil {
				return err
			}
			switch filepath.Ext(path) {
			case ".md", ".yaml", ".yml", ".tf":
				if !slices.Contains(files, path) {
					files = append(files, path)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	return files
}

// benchCommand is one `go test -bench` command quoted in a doc.
type benchCommand struct {
	quoted  string   // as quoted, whitespace collapsed
	args    []string // after `go test`
	pattern string   // -bench's
	pkgs    []string // the package paths, ./...
}

// codeSpan is a Markdown code span; it may wrap over lines of a paragraph
// (or of a comment block: its lines' leading `#` are taken out first).
var codeSpan = regexp.MustCompile("`([^`]+)`")

// quotedBenchCommands returns the `go test ... -bench ...` commands quoted
// as code spans in text.
func quotedBenchCommands(text string) []benchCommand {
	// A YAML or HCL comment that wraps a command: join its lines.
	text = regexp.MustCompile(`\n[ \t]*#+[ \t]?`).ReplaceAllString(text, "\n")
	// A fenced block's lines are commands as they stand; the spans are
	// looked for in the text between the blocks.
	var spans []string
	var prose strings.Builder
	fenced := false
	for line := range strings.Lines(text) {
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
			prose.WriteString("\n")
			continue
		}
		if fenced {
			spans = append(spans, line)
			continue
		}
		prose.WriteString(line)
	}
	for _, m := range codeSpan.FindAllStringSubmatch(prose.String(), -1) {
		spans = append(spans, m[1])
	}
	var cmds []benchCommand
	for _, span := range spans {
		quoted := strings.Join(strings.Fields(span), " ")
		quoted = strings.TrimPrefix(quoted, "$ ")
		rest, ok := strings.CutPrefix(quoted, "go test ")
		if !ok || !strings.Contains(rest, "-bench") {
			continue
		}
		c := benchCommand{quoted: quoted, args: shellWords(rest)}
		for i, a := range c.args {
			switch {
			case a == "-bench" && i+1 < len(c.args):
				c.pattern = c.args[i+1]
			case strings.HasPrefix(a, "-bench="):
				c.pattern = strings.TrimPrefix(a, "-bench=")
			case strings.HasPrefix(a, "./"):
				c.pkgs = append(c.pkgs, a)
			}
		}
		if c.pattern != "" {
			cmds = append(cmds, c)
		}
	}
	return cmds
}

// shellWords splits s as a shell would for what the docs quote: words
// separated by blanks, single or double quotes taken out.
func shellWords(s string) []string {
	var words []string
	var w strings.Builder
	in, quote := false, rune(0)
	for _, r := range s {
		switch {
		case quote != 0 && r == quote:
			quote = 0
		case quote != 0:
			w.WriteRune(r)
		case r == '\'' || r == '"':
			quote, in = r, true
		case r == ' ' || r == '\t':
			if in {
				words = append(words, w.String())
				w.Reset()
				in = false
			}
		default:
			w.WriteRune(r)
			in = true
		}
	}
	if in {
		words = append(words, w.String())
	}
	return words
}

// benchmarks returns the names of the benchmark functions of the package
// in dir (its _test.go files, both the package and its _test package).
func benchmarks(t *testing.T, dir string) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*_test.go"))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	fset := token.NewFileSet()
	for _, f := range files {
		af, err := parser.ParseFile(fset, f, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range af.Decls {
			fd, ok := d.(*ast.FuncDecl)
			if ok && fd.Recv == nil && strings.HasPrefix(fd.Name.Name, "Benchmark") && fd.Type.Params.NumFields() == 1 {
				names = append(names, fd.Name.Name)
			}
		}
	}
	return names
}

func TestQuotedBenchCommands(t *testing.T) {
	text := "```sh\ngo test -bench E ./e\n```\nFigures (`go test -run '^$' -bench 'A|B' -benchtime 1x\n./internal/x`) and\n" +
		"`go test -run X ./y` and `go test -bench=C ./a ./b`\n" +
		"          # applied (`go test -bench D\n          # ./internal/z`), mostly\n"
	got := quotedBenchCommands(text)
	want := []struct {
		pattern string
		pkgs    []string
	}{{"E", []string{"./e"}}, {"A|B", []string{"./internal/x"}}, {"C", []string{"./a", "./b"}}, {"D", []string{"./internal/z"}}}
	if len(got) != len(want) {
		t.Fatalf("got %d commands %+v, want %d", len(got), got, len(want))
	}
	for i, w := range want {
		if got[i].pattern != w.pattern || !slices.Equal(got[i].pkgs, w.pkgs) {
			t.Errorf("command %d: pattern %q packages %q, want %q %q", i, got[i].pattern, got[i].pkgs, w.pattern, w.pkgs)
		}
	}
}

// TestDocBenchmarks holds every `go test -bench` command the docs quote
// to the code: each names a package with a benchmark its pattern matches.
// With -docbench.run it also runs each one, once (-benchtime 1x, with the
// race detector as the rest of `make test`).
func TestDocBenchmarks(t *testing.T) {
	var cmds []benchCommand
	where := map[string]string{}
	for _, f := range docFiles(t) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range quotedBenchCommands(string(b)) {
			if _, seen := where[c.quoted]; !seen {
				where[c.quoted] = f
				cmds = append(cmds, c)
			}
		}
	}
	// The README's apply, overshoot and store figures at least; fewer
	// means the extraction broke, not that the docs lost them.
	if len(cmds) < 8 {
		t.Fatalf("found %d quoted benchmark commands, want at least 8: %q", len(cmds), cmds)
	}
	for _, c := range cmds {
		t.Logf("%s: %s", where[c.quoted], c.quoted)
		if len(c.pkgs) == 0 {
			t.Errorf("%s: %q names no package (./...)", where[c.quoted], c.quoted)
		}
		// The pattern's first level names the benchmark functions (a
		// pattern a/b: b is a sub-benchmark's, known only when it runs).
		top, _, _ := strings.Cut(c.pattern, "/")
		re, err := regexp.Compile(top)
		if err != nil {
			t.Errorf("%s: %q: -bench %q: %v", where[c.quoted], c.quoted, c.pattern, err)
			continue
		}
		for _, p := range c.pkgs {
			if strings.HasSuffix(p, "/...") {
				continue
			}
			names := benchmarks(t, filepath.Join("..", p))
			if !slices.ContainsFunc(names, re.MatchString) {
				t.Errorf("%s: %q: no benchmark of %s matches %q (it has %q)", where[c.quoted], c.quoted, p, top, names)
			}
		}
	}
	if !*docbenchRun || t.Failed() {
		return
	}
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("go not on PATH: %v", err)
	}
	ran := map[string]bool{}
	// Two at a time: most of a smoke run is its servers starting and
	// settling, not its one iteration.
	slots := make(chan struct{}, docbenchParallel)
	for _, c := range cmds {
		args := smokeArgs(c)
		if key := strings.Join(args, " "); ran[key] {
			continue // quoted twice, with other -count or -benchtime
		} else {
			ran[key] = true
		}
		t.Run(c.pattern+" "+strings.Join(c.pkgs, " "), func(t *testing.T) {
			t.Parallel()
			slots <- struct{}{}
			defer func() { <-slots }()
			cmd := exec.Command(goBin, args...)
			cmd.Dir = ".."
			began := time.Now()
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("go %s (%s quotes %q): %v\n%s", strings.Join(args, " "), where[c.quoted], c.quoted, err, out)
			}
			if !strings.Contains(string(out), "Benchmark") {
				t.Fatalf("go %s ran no benchmark:\n%s", strings.Join(args, " "), out)
			}
			t.Logf("go %s: %v", strings.Join(args, " "), time.Since(began).Round(time.Second))
		})
	}
}

// docbenchParallel is how many smoke runs go at once.
const docbenchParallel = 2

// smokeNarrow narrows a quoted pattern whose benchmark starts a new
// multi-region stack per sub-benchmark (a minute and more at 1x) to one of
// them, whatever sub-benchmarks the quote names ("Overshoot/shape=seed"
// too): the smoke run is to show the command still runs, not to take the
// figures. The narrowed commands then run once.
var smokeNarrow = map[string]string{
	"Overshoot": "Overshoot/shape=fast/interval=1s/wan=ref",
	// Two reconcilers: the partitions must spread over them first.
	"ApplyThroughput": "ApplyThroughput/partitions=8/reconcilers=2",
}

// smokeArgs is c's command run once: -benchtime 1x, the race detector, no
// test but the benchmarks, -count=1, and -short, which a benchmark whose
// one iteration is long may take to do less.
func smokeArgs(c benchCommand) []string {
	args := []string{"test", "-race", "-count=1", "-short"}
	for i := 0; i < len(c.args); i++ {
		a := c.args[i]
		switch {
		case a == "-benchtime" || a == "-count" || a == "-run" || a == "-bench":
			i++
		case strings.HasPrefix(a, "-benchtime=") || strings.HasPrefix(a, "-count=") || strings.HasPrefix(a, "-run=") || strings.HasPrefix(a, "-bench="):
		case strings.HasPrefix(a, "./"):
		default:
			args = append(args, a)
		}
	}
	pattern := c.pattern
	if top, _, _ := strings.Cut(pattern, "/"); smokeNarrow[top] != "" {
		pattern = smokeNarrow[top]
	}
	args = append(args, "-run", "^$", "-bench", pattern, "-benchtime", "1x")
	return append(args, c.pkgs...)
}

// TestSmokeArgs holds the smoke runs to one stack per multi-region
// benchmark, whatever sub-benchmarks a quote names.
func TestSmokeArgs(t *testing.T) {
	for pattern, want := range map[string]string{
		"Overshoot":                        smokeNarrow["Overshoot"],
		"Overshoot/shape=.*/interval=1s":   smokeNarrow["Overshoot"],
		"ApplyThroughput/small/":           smokeNarrow["ApplyThroughput"],
		"ScriptCost":                       "ScriptCost",
		"OvershootElsewhere/shape=seed":    "OvershootElsewhere/shape=seed",
		"StoreTake|ScriptCost/phase=check": "StoreTake|ScriptCost/phase=check",
	} {
		args := smokeArgs(benchCommand{pattern: pattern, pkgs: []string{"./x"}, args: []string{"-bench", pattern, "-count", "3"}})
		i := slices.Index(args, "-bench")
		if i < 0 || args[i+1] != want {
			t.Errorf("%q: smoke args %q, want -bench %q", pattern, args, want)
		}
		if slices.Contains(args, "3") {
			t.Errorf("%q: smoke args %q keep the quote's -count", pattern, args)
		}
	}
}
