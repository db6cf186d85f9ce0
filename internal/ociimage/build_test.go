package ociimage

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"github.com/limiterd/limiterd/internal/limiterd"
	"github.com/limiterd/limiterd/internal/reconciler"
)

const moduleDir = "../.."

func port(t *testing.T, addr string) string {
	t.Helper()
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	return p + "/tcp"
}

func daemon(t *testing.T, name string) Daemon {
	t.Helper()
	ds, err := Daemons()
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(ds, func(d Daemon) bool { return d.Name == name })
	if i < 0 {
		t.Fatalf("no daemon %s in %v", name, ds)
	}
	return ds[i]
}

func TestDaemonsPorts(t *testing.T) {
	tests := []struct {
		name  string
		ports []string
		cmd   []string
	}{
		{name: "limiterd",
			ports: []string{port(t, limiterd.DefaultGRPCAddress), port(t, limiterd.DefaultHTTPAddress)},
			cmd:   []string{"--grpc.listen-address=:8081", "--http.listen-address=:9091"}},
		{name: "reconciler",
			ports: []string{port(t, reconciler.DefaultHTTPAddress)},
			cmd:   []string{"--http.listen-address=:9191"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := daemon(t, tt.name)
			if !slices.Equal(d.Ports, tt.ports) || !slices.Equal(d.Cmd, tt.cmd) {
				t.Errorf("ports %q, cmd %q; want %q, %q", d.Ports, d.Cmd, tt.ports, tt.cmd)
			}
		})
	}
}

func TestMissingCACerts(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "limiterd")
	if err := os.WriteFile(bin, []byte("not a binary"), 0o755); err != nil {
		t.Fatal(err)
	}
	_, err := Image(daemon(t, "limiterd"), bin, Options{CACertsFile: filepath.Join(t.TempDir(), "none.crt")})
	if !errors.Is(err, ErrNoCACerts) {
		t.Errorf("Image without a CA bundle = %v, want ErrNoCACerts", err)
	}
}

// TestImages builds both images twice, with the command `make image`
// runs, reads each tarball back as docker load and crane push would, checks
// its config and files, runs the binary taken out of its layer, and
// compares the builds. The command runs as a process of its own: under
// go test -race, compressing the layers in this process takes a minute.
func TestImages(t *testing.T) {
	if _, err := os.Stat(CACertsPath); err != nil {
		// In CI a green run must mean the images were built.
		if os.Getenv("CI") == "true" {
			t.Fatalf("no CA bundle on this machine (%v): apt-get install ca-certificates", err)
		}
		t.Skipf("no CA bundle on this machine (%v): apt-get install ca-certificates", err)
	}
	// The first build compiles both daemons for the image's platform,
	// without the race detector: on a fresh machine, beside the other
	// tests, about 4 minutes. Each --help has its own 30 s after it.
	ctx, cancel := context.WithTimeout(context.Background(), 12*time.Minute)
	defer cancel()
	version, err := ReadVersion(moduleDir)
	if err != nil {
		t.Fatal(err)
	}
	rev, created := GitInfo(ctx, moduleDir)
	// The host's architecture, so that the binary runs here.
	opts := Options{ModuleDir: moduleDir, Version: version, Revision: rev, Created: created, Arch: runtime.GOARCH}
	ds, err := Daemons()
	if err != nil {
		t.Fatal(err)
	}

	tool := filepath.Join(t.TempDir(), "image")
	build := exec.CommandContext(ctx, "go", "build", "-o", tool, "./internal/tools/image")
	build.Dir = moduleDir
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./internal/tools/image: %v\n%s", err, out)
	}
	// digests runs the command into a new directory and returns it and
	// the digest it printed for each image.
	digests := func() (string, map[string]string) {
		t.Helper()
		dir := t.TempDir()
		start := time.Now()
		cmd := exec.CommandContext(ctx, tool, "--dir", dir, "--arch", opts.Arch)
		cmd.Dir = moduleDir
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("image --dir %s: %v\n%s", dir, err, out)
		}
		t.Logf("built in %v:\n%s", time.Since(start).Round(time.Millisecond), out)
		printed := map[string]string{}
		for line := range strings.Lines(string(out)) {
			// path  ref  linux/arch  digest  size ...
			if f := strings.Fields(line); len(f) >= 4 {
				printed[f[0]] = f[3]
			}
		}
		return dir, printed
	}
	first, printed := digests()
	second, printedAgain := digests()

	for _, d := range ds {
		t.Run(d.Name, func(t *testing.T) {
			b := &Built{Daemon: d, Ref: d.Ref(version), Path: filepath.Join(first, d.Name+".tar")}
			if b.Ref != Registry+"/"+d.Name+":"+version {
				t.Errorf("ref %s", b.Ref)
			}
			checkTarball(t, b)

			img, err := tarball.ImageFromPath(b.Path, nil)
			if err != nil {
				t.Fatal(err)
			}
			digest, err := img.Digest()
			if err != nil {
				t.Fatal(err)
			}
			if printed[b.Path] != digest.String() {
				t.Errorf("digest read back %v, printed %q", digest, printed[b.Path])
			}
			checkConfig(t, img, d, opts)
			bin := checkLayers(t, img, d, created)
			runHelp(t, ctx, bin, d)

			again := filepath.Join(second, d.Name+".tar")
			if printedAgain[again] != digest.String() {
				t.Errorf("two builds of one commit: digests %v and %q", digest, printedAgain[again])
			}
			one, _ := os.ReadFile(b.Path)
			two, _ := os.ReadFile(again)
			if !bytes.Equal(one, two) {
				t.Errorf("two builds of one commit: tarballs differ")
			}
		})
	}
}

// checkTarball reads the docker-save layout: a manifest.json naming the
// tag, the config and the layers, each of them in the tarball.
func checkTarball(t *testing.T, b *Built) {
	t.Helper()
	f, err := os.Open(b.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	entries := map[string][]byte{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(tr)
		if err != nil {
			t.Fatal(err)
		}
		entries[h.Name] = data
	}
	var manifest []struct {
		Config   string
		RepoTags []string
		Layers   []string
	}
	if err := json.Unmarshal(entries["manifest.json"], &manifest); err != nil {
		t.Fatalf("manifest.json: %v (entries %q)", err, slices.Sorted(maps.Keys(entries)))
	}
	if len(manifest) != 1 {
		t.Fatalf("manifest.json has %d images, want 1", len(manifest))
	}
	m := manifest[0]
	if !slices.Equal(m.RepoTags, []string{b.Ref}) {
		t.Errorf("RepoTags %q, want [%s]", m.RepoTags, b.Ref)
	}
	if entries[m.Config] == nil {
		t.Errorf("config %s is not in the tarball", m.Config)
	}
	if len(m.Layers) != 2 {
		t.Errorf("%d layers, want 2 (CA bundle, binary)", len(m.Layers))
	}
	for _, l := range m.Layers {
		if entries[l] == nil {
			t.Errorf("layer %s is not in the tarball", l)
		}
	}
	if want := 2 + len(m.Layers); len(entries) != want {
		t.Errorf("tarball entries %q, want manifest.json, the config and the layers", slices.Sorted(maps.Keys(entries)))
	}
}

func checkConfig(t *testing.T, img v1.Image, d Daemon, opts Options) {
	t.Helper()
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	c := cf.Config
	if !slices.Equal(c.Entrypoint, []string{BinDir + "/" + d.Name}) {
		t.Errorf("entrypoint %q", c.Entrypoint)
	}
	if !slices.Equal(c.Cmd, d.Cmd) {
		t.Errorf("cmd %q, want %q", c.Cmd, d.Cmd)
	}
	if c.User != "65532:65532" {
		t.Errorf("user %q, want 65532:65532", c.User)
	}
	if got := slices.Sorted(maps.Keys(c.ExposedPorts)); !slices.Equal(got, slices.Sorted(slices.Values(d.Ports))) {
		t.Errorf("exposed ports %q, want the flags' defaults %q", got, d.Ports)
	}
	if c.Shell != nil || len(c.Env) != 0 {
		t.Errorf("shell %q, env %q: want neither", c.Shell, c.Env)
	}
	if cf.OS != "linux" || cf.Architecture != opts.Arch {
		t.Errorf("platform %s/%s, want linux/%s", cf.OS, cf.Architecture, opts.Arch)
	}
	if !cf.Created.Time.Equal(opts.Created) {
		t.Errorf("created %v, want %v", cf.Created.Time, opts.Created)
	}
	want := map[string]string{
		"org.opencontainers.image.source":  Source,
		"org.opencontainers.image.title":   d.Name,
		"org.opencontainers.image.version": opts.Version,
	}
	if opts.Revision != "" {
		want["org.opencontainers.image.revision"] = opts.Revision
	}
	if !maps.Equal(c.Labels, want) {
		t.Errorf("labels %v, want %v", c.Labels, want)
	}
}

// checkLayers lists every file of the image: the CA bundle and the binary
// under their directories, owned by root, at the commit's time; nothing
// else (no shell). It returns the binary's content.
func checkLayers(t *testing.T, img v1.Image, d Daemon, created time.Time) []byte {
	t.Helper()
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	type entry struct {
		mode int64
		dir  bool
	}
	got := map[string]entry{}
	var bin, ca []byte
	for _, l := range layers {
		rc, err := l.Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		tr := tar.NewReader(rc)
		for {
			h, err := tr.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
			if h.Uid != 0 || h.Gid != 0 || !h.ModTime.Equal(created) {
				t.Errorf("%s: owner %d:%d, time %v; want 0:0 at %v", h.Name, h.Uid, h.Gid, h.ModTime, created)
			}
			got["/"+strings.TrimSuffix(h.Name, "/")] = entry{mode: h.Mode, dir: h.Typeflag == tar.TypeDir}
			switch "/" + h.Name {
			case d.BinaryPath():
				bin, _ = io.ReadAll(tr)
			case CACertsPath:
				ca, _ = io.ReadAll(tr)
			}
		}
		rc.Close()
	}
	want := map[string]entry{
		"/etc": {0o755, true}, "/etc/ssl": {0o755, true}, "/etc/ssl/certs": {0o755, true},
		CACertsPath: {0o644, false},
		"/usr":      {0o755, true}, "/usr/local": {0o755, true}, "/usr/local/bin": {0o755, true},
		d.BinaryPath(): {0o755, false},
	}
	if !maps.Equal(got, want) {
		t.Errorf("files %v, want %v", got, want)
	}
	host, err := os.ReadFile(CACertsPath)
	if err != nil || !bytes.Equal(ca, host) {
		t.Errorf("the image's CA bundle (%d bytes) is not this machine's %s (%v)", len(ca), CACertsPath, err)
	}
	if len(bin) == 0 {
		t.Fatalf("no %s in the layers", d.BinaryPath())
	}
	return bin
}

// runHelp runs the binary out of the layer with --help: it is static, so
// it runs outside the image as well.
func runHelp(t *testing.T, ctx context.Context, bin []byte, d Daemon) {
	t.Helper()
	file := filepath.Join(t.TempDir(), d.Name)
	if err := os.WriteFile(file, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, file, "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("%s --help: %v\n%s", d.Name, err, out)
	}
	for _, flag := range []string{"-http.listen-address", "-redis.addrs", "-nats.url"} {
		if !strings.Contains(string(out), "  "+flag+" ") {
			t.Errorf("%s --help lists no %s:\n%s", d.Name, flag, out)
		}
	}
}
