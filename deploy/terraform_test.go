package deploy

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/hclparse"
	"github.com/hashicorp/hcl/v2/hclsyntax"
	"github.com/zclconf/go-cty/cty"
	"github.com/zclconf/go-cty/cty/function"
	"github.com/zclconf/go-cty/cty/function/stdlib"
)

// Terraform trees, relative to this package. The module reads the NATS
// template from natsDir, so both are copied together for terraform.
const (
	terraformDir = "terraform"
	natsDir      = "nats"
)

// tfModule is one directory of .tf files, parsed.
type tfModule struct {
	dir    string
	files  map[string]*hclsyntax.Body
	vars   map[string]*hclsyntax.Block
	locals map[string]bool
	mods   map[string]*hclsyntax.Block
	res    map[string]bool // "type.name" of resources; "data.type.name" of data sources
	outs   map[string]*hclsyntax.Block
}

// parseTerraform parses every .tf file of every module directory under root.
func parseTerraform(root string) ([]*tfModule, error) {
	byDir := map[string]*tfModule{}
	parser := hclparse.NewParser()
	err := filepath.WalkDir(root, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if e.IsDir() && strings.HasPrefix(e.Name(), ".") && p != root {
			return filepath.SkipDir
		}
		if e.IsDir() || filepath.Ext(p) != ".tf" {
			return nil
		}
		f, diags := parser.ParseHCLFile(p)
		if diags.HasErrors() {
			return diags
		}
		dir := filepath.Dir(p)
		m := byDir[dir]
		if m == nil {
			m = &tfModule{dir: dir, files: map[string]*hclsyntax.Body{}, vars: map[string]*hclsyntax.Block{},
				locals: map[string]bool{}, mods: map[string]*hclsyntax.Block{}, res: map[string]bool{}, outs: map[string]*hclsyntax.Block{}}
			byDir[dir] = m
		}
		body := f.Body.(*hclsyntax.Body)
		m.files[p] = body
		for _, b := range body.Blocks {
			switch b.Type {
			case "variable":
				m.vars[b.Labels[0]] = b
			case "locals":
				for name := range b.Body.Attributes {
					m.locals[name] = true
				}
			case "module":
				m.mods[b.Labels[0]] = b
			case "resource":
				m.res[b.Labels[0]+"."+b.Labels[1]] = true
			case "data":
				m.res["data."+b.Labels[0]+"."+b.Labels[1]] = true
			case "output":
				m.outs[b.Labels[0]] = b
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	var out []*tfModule
	for _, dir := range slices.Sorted(maps.Keys(byDir)) {
		out = append(out, byDir[dir])
	}
	return out, nil
}

// checkReferences reports every var.X, local.X, module.X, data.T.N and
// aws_T.N a module refers to but does not declare.
func (m *tfModule) checkReferences() []error {
	var errs []error
	for _, file := range slices.Sorted(maps.Keys(m.files)) {
		_ = hclsyntax.VisitAll(m.files[file], func(n hclsyntax.Node) hcl.Diagnostics {
			e, ok := n.(hclsyntax.Expression)
			if !ok {
				return nil
			}
			for _, tr := range e.Variables() {
				root := tr.RootName()
				attr := func(i int) string {
					if len(tr) > i {
						if a, ok := tr[i].(hcl.TraverseAttr); ok {
							return a.Name
						}
					}
					return ""
				}
				at := tr.SourceRange()
				switch {
				case root == "var" && m.vars[attr(1)] == nil:
					errs = append(errs, fmt.Errorf("%s: var.%s is not declared in %s", at, attr(1), m.dir))
				case root == "local" && !m.locals[attr(1)]:
					errs = append(errs, fmt.Errorf("%s: local.%s is not declared in %s", at, attr(1), m.dir))
				case root == "module" && m.mods[attr(1)] == nil:
					errs = append(errs, fmt.Errorf("%s: module.%s is not declared in %s", at, attr(1), m.dir))
				case root == "data" && !m.res["data."+attr(1)+"."+attr(2)]:
					errs = append(errs, fmt.Errorf("%s: data.%s.%s is not declared in %s", at, attr(1), attr(2), m.dir))
				case strings.HasPrefix(root, "aws_") && !m.res[root+"."+attr(1)]:
					errs = append(errs, fmt.Errorf("%s: %s.%s is not declared in %s", at, root, attr(1), m.dir))
				}
			}
			return nil
		})
	}
	return errs
}

// checkDocumented reports a variable without a description, a type or a
// validation block (with a condition and an error message), and an output
// without a description.
func (m *tfModule) checkDocumented() []error {
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(m.vars)) {
		b := m.vars[name]
		for _, a := range []string{"description", "type"} {
			if b.Body.Attributes[a] == nil {
				errs = append(errs, fmt.Errorf("%s: variable %q has no %s", b.DefRange(), name, a))
			}
		}
		validations := 0
		for _, v := range b.Body.Blocks {
			if v.Type != "validation" {
				continue
			}
			validations++
			if v.Body.Attributes["condition"] == nil || v.Body.Attributes["error_message"] == nil {
				errs = append(errs, fmt.Errorf("%s: a validation of variable %q lacks condition or error_message", v.DefRange(), name))
			}
		}
		if validations == 0 {
			errs = append(errs, fmt.Errorf("%s: variable %q has no validation block", b.DefRange(), name))
		}
	}
	for _, name := range slices.Sorted(maps.Keys(m.outs)) {
		if m.outs[name].Body.Attributes["description"] == nil {
			errs = append(errs, fmt.Errorf("%s: output %q has no description", m.outs[name].DefRange(), name))
		}
	}
	return errs
}

// staticString evaluates an expression made of literals and path.module.
func staticString(e hclsyntax.Expression, module string) (string, bool) {
	v, diags := e.Value(&hcl.EvalContext{Variables: map[string]cty.Value{
		"path": cty.ObjectVal(map[string]cty.Value{"module": cty.StringVal(module)}),
	}})
	if diags.HasErrors() || !v.IsKnown() || v.IsNull() || v.Type() != cty.String {
		return "", false
	}
	return v.AsString(), true
}

// checkCalls checks the module calls and templatefile calls of a module:
// a local module source exists, every argument is a variable of it and
// every variable without a default is given; a template exists, parses, and
// every variable it uses is in the object passed to it.
func (m *tfModule) checkCalls(all []*tfModule) []error {
	var errs []error
	byDir := map[string]*tfModule{}
	for _, o := range all {
		byDir[filepath.Clean(o.dir)] = o
	}
	for _, name := range slices.Sorted(maps.Keys(m.mods)) {
		b := m.mods[name]
		srcAttr := b.Body.Attributes["source"]
		if srcAttr == nil {
			errs = append(errs, fmt.Errorf("%s: module %q has no source", b.DefRange(), name))
			continue
		}
		src, ok := staticString(srcAttr.Expr, m.dir)
		if !ok || !strings.HasPrefix(src, "./") && !strings.HasPrefix(src, "../") {
			errs = append(errs, fmt.Errorf("%s: module %q: source must be a local path here", b.DefRange(), name))
			continue
		}
		callee := byDir[filepath.Clean(filepath.Join(m.dir, src))]
		if callee == nil {
			errs = append(errs, fmt.Errorf("%s: module %q: no module at %s", b.DefRange(), name, src))
			continue
		}
		meta := map[string]bool{"source": true, "version": true, "providers": true, "count": true, "for_each": true, "depends_on": true}
		for arg := range b.Body.Attributes {
			if !meta[arg] && callee.vars[arg] == nil {
				errs = append(errs, fmt.Errorf("%s: module %q: %s is not a variable of %s", b.Body.Attributes[arg].SrcRange, name, arg, callee.dir))
			}
		}
		for v, vb := range callee.vars {
			if vb.Body.Attributes["default"] == nil && b.Body.Attributes[v] == nil {
				errs = append(errs, fmt.Errorf("%s: module %q: required variable %s is not given", b.DefRange(), name, v))
			}
		}
	}
	for _, file := range slices.Sorted(maps.Keys(m.files)) {
		_ = hclsyntax.VisitAll(m.files[file], func(n hclsyntax.Node) hcl.Diagnostics {
			call, ok := n.(*hclsyntax.FunctionCallExpr)
			if !ok || call.Name != "templatefile" {
				return nil
			}
			if len(call.Args) != 2 {
				errs = append(errs, fmt.Errorf("%s: templatefile takes 2 arguments", call.Range()))
				return nil
			}
			path, ok := staticString(call.Args[0], m.dir)
			if !ok {
				errs = append(errs, fmt.Errorf("%s: templatefile path must be literals and path.module", call.Range()))
				return nil
			}
			src, err := os.ReadFile(path)
			if err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", call.Range(), err))
				return nil
			}
			tmpl, diags := hclsyntax.ParseTemplate(src, path, hcl.InitialPos)
			if diags.HasErrors() {
				errs = append(errs, diags)
				return nil
			}
			obj, ok := call.Args[1].(*hclsyntax.ObjectConsExpr)
			if !ok {
				errs = append(errs, fmt.Errorf("%s: templatefile variables must be an object literal", call.Range()))
				return nil
			}
			given := map[string]bool{}
			for _, it := range obj.Items {
				if k := hcl.ExprAsKeyword(it.KeyExpr); k != "" {
					given[k] = true
				}
			}
			for _, tr := range tmpl.Variables() {
				if !given[tr.RootName()] {
					errs = append(errs, fmt.Errorf("%s: template %s uses %s, which templatefile does not pass", call.Range(), path, tr.RootName()))
				}
			}
			return nil
		})
	}
	return errs
}

// checkProviders keeps every module on the AWS provider alone, so that it
// validates against the mirror: resources and data sources are aws_*, and
// required_providers names only hashicorp/aws.
func (m *tfModule) checkProviders() []error {
	var errs []error
	for r := range m.res {
		if !strings.HasPrefix(strings.TrimPrefix(r, "data."), "aws_") {
			errs = append(errs, fmt.Errorf("%s: %s is not an AWS provider resource", m.dir, r))
		}
	}
	required := 0
	for _, body := range m.files {
		for _, b := range body.Blocks {
			if b.Type != "terraform" {
				continue
			}
			for _, rp := range b.Body.Blocks {
				if rp.Type != "required_providers" {
					continue
				}
				for name, a := range rp.Body.Attributes {
					required++
					v, diags := a.Expr.Value(nil)
					if name != "aws" || diags.HasErrors() || !v.Type().IsObjectType() || !v.Type().HasAttribute("source") ||
						v.GetAttr("source").AsString() != "hashicorp/aws" {
						errs = append(errs, fmt.Errorf("%s: required provider %s: only hashicorp/aws is allowed", a.SrcRange, name))
					}
				}
			}
		}
	}
	if required == 0 {
		errs = append(errs, fmt.Errorf("%s: no required_providers", m.dir))
	}
	return errs
}

// TestTerraformHCL parses every Terraform file with hclparse and checks each
// module: every var, local, module, data and resource it refers to is
// declared; every variable has a description, a type and a validation
// block; every output a description; module calls pass exactly the callee's
// variables; templatefile calls name templates that parse and get every
// variable they use; only the AWS provider is used; an example's
// terraform.tfvars.example sets only its variables. It needs no terraform.
func TestTerraformHCL(t *testing.T) {
	mods, err := parseTerraform(terraformDir)
	if err != nil {
		t.Fatal(err)
	}
	dirs := map[string]bool{}
	for _, m := range mods {
		dirs[filepath.ToSlash(m.dir)] = true
	}
	for _, want := range []string{"terraform/modules/region", "terraform/examples/two-regions"} {
		if !dirs[want] {
			t.Errorf("no Terraform module in %s", want)
		}
	}
	examples, err := filepath.Glob(filepath.Join(terraformDir, "examples", "*", "*.tfvars.example"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range examples {
		t.Run(filepath.ToSlash(p), func(t *testing.T) {
			f, diags := hclparse.NewParser().ParseHCLFile(p)
			if diags.HasErrors() {
				t.Fatal(diags)
			}
			var m *tfModule
			for _, o := range mods {
				if o.dir == filepath.Dir(p) {
					m = o
				}
			}
			if m == nil {
				t.Fatalf("no module beside %s", p)
			}
			for name, a := range f.Body.(*hclsyntax.Body).Attributes {
				if m.vars[name] == nil {
					t.Errorf("%s: %s is not a variable of %s", a.SrcRange, name, m.dir)
				}
			}
		})
	}
	for _, m := range mods {
		t.Run(filepath.ToSlash(m.dir), func(t *testing.T) {
			for _, check := range []func() []error{m.checkReferences, m.checkDocumented, func() []error { return m.checkCalls(mods) }, m.checkProviders} {
				for _, err := range check() {
					t.Error(err)
				}
			}
		})
	}
}

// renderTemplate renders a Terraform template file with vars, as
// templatefile would (with the functions these templates use).
func renderTemplate(path string, vars map[string]cty.Value) (string, error) {
	src, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	tmpl, diags := hclsyntax.ParseTemplate(src, path, hcl.InitialPos)
	if diags.HasErrors() {
		return "", diags
	}
	v, diags := tmpl.Value(&hcl.EvalContext{Variables: vars, Functions: map[string]function.Function{"join": stdlib.JoinFunc}})
	if diags.HasErrors() {
		return "", diags
	}
	return v.AsString(), nil
}

// envKeys returns the KEY of every KEY=value line of an env file, in order.
func envKeys(text string) ([]string, error) {
	var keys []string
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, _, ok := strings.Cut(line, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("line %q is not KEY=value", line)
		}
		keys = append(keys, k)
	}
	return keys, sc.Err()
}

// TestTerraformTemplates renders the templates the module hands on: the
// NATS server configuration (one cluster named after the region, a route to
// every server, a gateway to every other region) and the overlay's
// infra.env, whose keys must be those of every overlay's infra.env and
// must all be read by the manifests.
func TestTerraformTemplates(t *testing.T) {
	hosts := []cty.Value{cty.StringVal("nats-0.us-east.limiterd.internal"), cty.StringVal("nats-1.us-east.limiterd.internal"), cty.StringVal("nats-2.us-east.limiterd.internal")}
	conf, err := renderTemplate(filepath.Join(natsDir, "nats-server.conf.tftpl"), map[string]cty.Value{
		"server_name":  cty.StringVal("nats-0.us-east.limiterd.internal"),
		"region_name":  cty.StringVal("us-east"),
		"client_port":  cty.NumberIntVal(4222),
		"cluster_port": cty.NumberIntVal(6222),
		"gateway_port": cty.NumberIntVal(7222),
		"monitor_port": cty.NumberIntVal(8222),
		"routes":       cty.ListVal(hosts),
		"gateways": cty.MapVal(map[string]cty.Value{"eu-west": cty.ListVal([]cty.Value{
			cty.StringVal("nats://nats-0.eu-west.limiterd.internal:7222"), cty.StringVal("nats://nats-1.eu-west.limiterd.internal:7222")})}),
		"max_file_store_gb": cty.NumberIntVal(16),
	})
	if err != nil {
		t.Fatalf("nats-server.conf.tftpl: %v", err)
	}
	for _, want := range []string{
		"cluster {\n  name: \"us-east\"",
		"gateway {\n  name: \"us-east\"",
		"\"nats-route://nats-2.us-east.limiterd.internal:6222\"",
		`{ name: "eu-west", urls: ["nats://nats-0.eu-west.limiterd.internal:7222", "nats://nats-1.eu-west.limiterd.internal:7222"] }`,
		"max_file_store: 16GB",
		"jetstream {",
	} {
		if !strings.Contains(conf, want) {
			t.Errorf("rendered NATS configuration lacks %q:\n%s", want, conf)
		}
	}
	if strings.Count(conf, "nats-route://") != len(hosts) {
		t.Errorf("rendered NATS configuration has %d routes, want %d", strings.Count(conf, "nats-route://"), len(hosts))
	}
	if strings.Count(conf, "{") != strings.Count(conf, "}") || strings.Count(conf, "[") != strings.Count(conf, "]") {
		t.Errorf("rendered NATS configuration has unbalanced braces or brackets:\n%s", conf)
	}

	ud, err := renderTemplate(filepath.Join(terraformDir, "modules", "region", "templates", "nats-user-data.sh.tftpl"),
		map[string]cty.Value{"nats_config": cty.StringVal(conf)})
	if err != nil || !strings.HasPrefix(ud, "#!/bin/bash\n") || !strings.Contains(ud, conf) {
		t.Errorf("nats-user-data.sh.tftpl: %v; want a bash script embedding the configuration", err)
	}

	env, err := renderTemplate(filepath.Join(terraformDir, "modules", "region", "templates", "k8s-infra.env.tftpl"), map[string]cty.Value{
		"region_name": cty.StringVal("us-east"),
		"redis_addrs": cty.StringVal("clustercfg.limiterd-us-east.abc123.use1.cache.amazonaws.com:6379"),
		"nats_url":    cty.StringVal("nats://nats-0.us-east.limiterd.internal:4222"),
	})
	if err != nil {
		t.Fatalf("k8s-infra.env.tftpl: %v", err)
	}
	want, err := envKeys(env)
	if err != nil {
		t.Fatalf("rendered infra.env: %v", err)
	}
	for _, dir := range overlayDirs(t) {
		data, err := os.ReadFile(filepath.Join(dir, "infra.env"))
		if err != nil {
			t.Fatal(err)
		}
		got, err := envKeys(string(data))
		if err != nil {
			t.Fatalf("%s/infra.env: %v", dir, err)
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s/infra.env has keys %q, Terraform writes %q", dir, got, want)
		}
		b := buildOverlay(t, dir)
		for _, k := range want {
			read := false
			for _, dep := range b.deployments {
				for _, c := range dep.Spec.Template.Spec.Containers {
					env, err := containerEnv(b, c)
					if err != nil {
						t.Fatal(err)
					}
					_, ok := env[k]
					read = read || ok
				}
			}
			if !read {
				t.Errorf("%s: no container reads %s, which Terraform writes to infra.env", dir, k)
			}
		}
	}
}

// pluginMirror returns the root of a filesystem mirror holding the AWS
// provider (the machine image puts one at /<dir>/tf-plugins), or "".
func pluginMirror() string {
	candidates, _ := filepath.Glob("/*/tf-plugins")
	if m := os.Getenv("TF_PLUGIN_MIRROR"); m != "" {
		candidates = append([]string{m}, candidates...)
	}
	for _, c := range candidates {
		if fi, err := os.Stat(filepath.Join(c, "registry.terraform.io", "hashicorp", "aws")); err == nil && fi.IsDir() {
			return c
		}
	}
	return ""
}

// copyTree copies the regular files of src into dst, skipping dot
// directories (.terraform).
func copyTree(src, dst string) error {
	return filepath.WalkDir(src, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		if e.IsDir() {
			if strings.HasPrefix(e.Name(), ".") && p != src {
				return filepath.SkipDir
			}
			return os.MkdirAll(filepath.Join(dst, rel), 0o755)
		}
		if !e.Type().IsRegular() {
			return nil
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dst, rel), data, 0o644)
	})
}

// TestTerraformValidate runs `terraform fmt -check`, then
// `terraform init -backend=false` and `terraform validate` on every module
// and example, in a temporary copy, against the real AWS provider schema
// from a local filesystem mirror. Without terraform or the mirror it logs
// so and passes: TestTerraformHCL is the floor.
func TestTerraformValidate(t *testing.T) {
	tf, err := exec.LookPath("terraform")
	mirror := pluginMirror()
	if err != nil || mirror == "" {
		t.Logf("terraform validate not run: terraform on PATH: %v; AWS provider mirror (/*/tf-plugins or $TF_PLUGIN_MIRROR): %q. TestTerraformHCL still checks the HCL.", err == nil, mirror)
		return
	}
	tmp := t.TempDir()
	for _, d := range []string{terraformDir, natsDir} {
		if err := copyTree(d, filepath.Join(tmp, d)); err != nil {
			t.Fatal(err)
		}
	}
	cli := filepath.Join(tmp, "terraform.rc")
	cfg := fmt.Sprintf("provider_installation {\n  filesystem_mirror {\n    path    = %q\n    include = [\"registry.terraform.io/*/*\"]\n  }\n}\n", mirror)
	if err := os.WriteFile(cli, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	var env []string
	for _, kv := range os.Environ() {
		if k, _, _ := strings.Cut(kv, "="); !slices.Contains([]string{"TF_CLI_CONFIG_FILE", "TF_DATA_DIR", "TF_PLUGIN_CACHE_DIR", "TF_WORKSPACE"}, k) {
			env = append(env, kv)
		}
	}
	env = append(env, "TF_CLI_CONFIG_FILE="+cli, "TF_IN_AUTOMATION=1", "TF_INPUT=0", "CHECKPOINT_DISABLE=1")
	run := func(t *testing.T, dir string, args ...string) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, tf, args...)
		cmd.Dir, cmd.Env = dir, env
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			t.Fatalf("terraform %s in %s: %v\n%s", strings.Join(args, " "), dir, err, out.String())
		}
	}
	t.Run("fmt", func(t *testing.T) {
		run(t, filepath.Join(tmp, terraformDir), "fmt", "-check", "-recursive", "-diff", "-no-color")
	})
	mods, err := parseTerraform(terraformDir)
	if err != nil {
		t.Fatal(err)
	}
	var dirs []string
	for _, m := range mods {
		dirs = append(dirs, m.dir)
	}
	sort.Strings(dirs)
	for _, d := range dirs {
		t.Run(filepath.ToSlash(d), func(t *testing.T) {
			dir := filepath.Join(tmp, d)
			run(t, dir, "init", "-backend=false", "-input=false", "-no-color")
			run(t, dir, "validate", "-no-color")
		})
	}
}
