package ociimage

import (
	"bufio"
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// instruction is one Dockerfile instruction, its continuation lines joined.
type instruction struct {
	line    int
	keyword string // upper case
	args    string
}

// parseDockerfile splits a Dockerfile into instructions: comments and blank
// lines dropped, lines ending in a backslash joined to the next. That is
// the whole of the format's line syntax (no parser directives are used);
// docker build itself cannot run here.
func parseDockerfile(t *testing.T, file string) []instruction {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var out []instruction
	var cur strings.Builder
	start := 0
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if cur.Len() == 0 {
			start = n
		}
		more := strings.HasSuffix(line, `\`)
		cur.WriteString(strings.TrimSuffix(line, `\`))
		if more {
			cur.WriteString(" ")
			continue
		}
		keyword, args, _ := strings.Cut(cur.String(), " ")
		out = append(out, instruction{line: start, keyword: strings.ToUpper(keyword), args: strings.TrimSpace(args)})
		cur.Reset()
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	if cur.Len() > 0 {
		t.Fatalf("%s ends in a line continuation", file)
	}
	return out
}

// stage is what a final stage of the Dockerfile says about its image.
type stage struct {
	from            string
	entrypoint, cmd []string
	user            string
	ports           []string
	labels          map[string]string
	copies          map[string]string // destination -> source
	args            map[string]string // ARG defaults
}

func TestDockerfile(t *testing.T) {
	file := filepath.Join(moduleDir, "Dockerfile")
	known := []string{"FROM", "ARG", "RUN", "COPY", "ENV", "WORKDIR", "USER", "EXPOSE", "LABEL", "ENTRYPOINT", "CMD"}
	stages := map[string]*stage{}
	var cur *stage
	for _, in := range parseDockerfile(t, file) {
		if !slices.Contains(known, in.keyword) {
			t.Errorf("Dockerfile:%d: unknown instruction %s", in.line, in.keyword)
			continue
		}
		if in.keyword != "FROM" && in.keyword != "ARG" && cur == nil {
			t.Errorf("Dockerfile:%d: %s before the first FROM", in.line, in.keyword)
			continue
		}
		switch in.keyword {
		case "FROM":
			f := strings.Fields(in.args)
			if len(f) != 3 || !strings.EqualFold(f[1], "AS") {
				t.Errorf("Dockerfile:%d: FROM %s: want FROM <image> AS <stage>", in.line, in.args)
				continue
			}
			cur = &stage{from: f[0], labels: map[string]string{}, copies: map[string]string{}, args: map[string]string{}}
			stages[f[2]] = cur
		case "ARG":
			if cur != nil {
				k, v, _ := strings.Cut(in.args, "=")
				cur.args[k] = v
			}
		case "ENTRYPOINT", "CMD":
			var argv []string
			if err := json.Unmarshal([]byte(in.args), &argv); err != nil {
				t.Errorf("Dockerfile:%d: %s %s: not the exec (JSON) form, which runs no shell: %v", in.line, in.keyword, in.args, err)
			}
			if in.keyword == "CMD" {
				cur.cmd = argv
			} else {
				cur.entrypoint = argv
			}
		case "USER":
			cur.user = in.args
		case "EXPOSE":
			cur.ports = append(cur.ports, strings.Fields(in.args)...)
		case "LABEL":
			for _, kv := range splitLabels(t, in) {
				cur.labels[kv[0]] = kv[1]
			}
		case "COPY":
			f := strings.Fields(in.args)
			if len(f) == 3 && strings.HasPrefix(f[0], "--from=") {
				cur.copies[f[2]] = f[1]
			}
		}
	}

	version, err := ReadVersion(moduleDir)
	if err != nil {
		t.Fatal(err)
	}
	ds, err := Daemons()
	if err != nil {
		t.Fatal(err)
	}
	if len(stages) != 1+len(ds) || stages["build"] == nil {
		t.Errorf("stages %q, want build and one per daemon", slices.Sorted(maps.Keys(stages)))
	}
	for _, d := range ds {
		t.Run(d.Name, func(t *testing.T) {
			s := stages[d.Name]
			if s == nil {
				t.Fatalf("no stage %s (docker build --target %s)", d.Name, d.Name)
			}
			want := Config(d, Options{Version: version})
			if s.from != "scratch" {
				t.Errorf("FROM %s, want scratch: the Go-built image has no base", s.from)
			}
			if !slices.Equal(s.entrypoint, want.Entrypoint) || !slices.Equal(s.cmd, want.Cmd) {
				t.Errorf("ENTRYPOINT %q CMD %q, want %q %q", s.entrypoint, s.cmd, want.Entrypoint, want.Cmd)
			}
			if s.user != want.User {
				t.Errorf("USER %q, want %q", s.user, want.User)
			}
			if got := slices.Sorted(slices.Values(s.ports)); !slices.Equal(got, slices.Sorted(maps.Keys(want.ExposedPorts))) {
				t.Errorf("EXPOSE %q, want %q", got, slices.Sorted(maps.Keys(want.ExposedPorts)))
			}
			if v := s.args["VERSION"]; v != version {
				t.Errorf("ARG VERSION=%s, want %s (the file %s)", v, version, VersionFile)
			}
			labels := maps.Clone(s.labels)
			for k, v := range labels {
				labels[k] = strings.ReplaceAll(v, "${VERSION}", s.args["VERSION"])
			}
			if !maps.Equal(labels, want.Labels) {
				t.Errorf("LABEL %v, want %v", labels, want.Labels)
			}
			// The files of the Go-built image, from the build stage.
			wantCopies := map[string]string{CACertsPath: CACertsPath, d.BinaryPath(): "/out/" + d.Name}
			if !maps.Equal(s.copies, wantCopies) {
				t.Errorf("COPY --from=build %v, want %v", s.copies, wantCopies)
			}
		})
	}
}

// splitLabels reads LABEL k="v" k2="v2" (values quoted, as in the
// Dockerfile).
func splitLabels(t *testing.T, in instruction) [][2]string {
	t.Helper()
	var out [][2]string
	rest := in.args
	for rest = strings.TrimSpace(rest); rest != ""; rest = strings.TrimSpace(rest) {
		k, after, ok := strings.Cut(rest, "=")
		if !ok {
			t.Errorf("Dockerfile:%d: LABEL %s: want key=\"value\"", in.line, rest)
			return out
		}
		v, err := strconv.QuotedPrefix(after)
		if err != nil {
			t.Errorf("Dockerfile:%d: LABEL %s: value not quoted: %v", in.line, k, err)
			return out
		}
		uq, _ := strconv.Unquote(v)
		out = append(out, [2]string{k, uq})
		rest = after[len(v):]
	}
	return out
}
