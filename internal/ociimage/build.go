package ociimage

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// DefaultArch is the architecture built when neither --arch nor GOARCH says.
const DefaultArch = "amd64"

// VersionFile, at the module root, holds the version the images are tagged
// with (deploy/k8s and deploy/terraform name the same).
const VersionFile = "VERSION"

// ErrNoCACerts is returned when the CA bundle to copy into the images is
// missing.
var ErrNoCACerts = errors.New("no CA bundle to put in the image")

// Options say how to build. The zero Options builds amd64 in the current
// directory with no version, revision or labels of either, at the Unix epoch.
type Options struct {
	// ModuleDir is the module root the binaries are built in ("": the
	// current directory).
	ModuleDir string
	// Version tags the image and is its org.opencontainers.image.version.
	Version string
	// Revision is the org.opencontainers.image.revision label (a git
	// commit), left out when "".
	Revision string
	// Created is every timestamp of the image: its config's, its history's
	// and its files' (the commit's time makes a commit's builds identical).
	Created time.Time
	// Arch is the GOARCH of the binary and the image ("": DefaultArch).
	Arch string
	// CACertsFile is the CA bundle copied to CACertsPath ("": CACertsPath
	// on this machine).
	CACertsFile string
	// Go is the go command ("": "go").
	Go string
}

func (o Options) arch() string {
	if o.Arch == "" {
		return DefaultArch
	}
	return o.Arch
}

// ReadVersion reads VersionFile in dir.
func ReadVersion(dir string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, VersionFile))
	if err != nil {
		return "", err
	}
	v := strings.TrimSpace(string(b))
	if v == "" || strings.ContainsAny(v, " \t\n:/") {
		return "", fmt.Errorf("%s: %q is no image tag", VersionFile, v)
	}
	return v, nil
}

// GitInfo is the commit checked out in dir and its commit time, or "" and
// the Unix epoch when git cannot say (no git, not a repository).
func GitInfo(ctx context.Context, dir string) (revision string, created time.Time) {
	out, err := exec.CommandContext(ctx, "git", "-C", dir, "log", "-1", "--format=%H %ct").Output()
	if err != nil {
		return "", time.Unix(0, 0).UTC()
	}
	rev, ts, ok := strings.Cut(strings.TrimSpace(string(out)), " ")
	sec, err := strconv.ParseInt(ts, 10, 64)
	if !ok || err != nil {
		return "", time.Unix(0, 0).UTC()
	}
	return rev, time.Unix(sec, 0).UTC()
}

// BuildBinary compiles d's command, static (CGO_ENABLED=0), for linux and
// opts' architecture, into file.
func BuildBinary(ctx context.Context, d Daemon, opts Options, file string) error {
	goCmd := opts.Go
	if goCmd == "" {
		goCmd = "go"
	}
	// -trimpath and no symbol table: the binary depends on the source, not
	// on where it was built; the build info still records the module
	// versions and the git revision (`go version -m`).
	cmd := exec.CommandContext(ctx, goCmd, "build", "-trimpath", "-ldflags=-s -w", "-o", file, d.Package)
	cmd.Dir = opts.ModuleDir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+opts.arch())
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build %s: %w\n%s", d.Package, err, stderr.Bytes())
	}
	return nil
}

// Image assembles d's image around binary (a file BuildBinary wrote): one
// layer with the CA bundle, one with the binary, and the config: entrypoint
// the binary, user User, d's ports, linux/opts.Arch.
func Image(d Daemon, binary string, opts Options) (v1.Image, error) {
	caFile := opts.CACertsFile
	if caFile == "" {
		caFile = CACertsPath
	}
	ca, err := os.ReadFile(caFile)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w: %s is missing (on Debian: apt-get install ca-certificates)", ErrNoCACerts, caFile)
	}
	if err != nil {
		return nil, err
	}
	bin, err := os.ReadFile(binary)
	if err != nil {
		return nil, err
	}
	created := opts.Created.UTC()
	caLayer, err := layer(created, file{CACertsPath, 0o644, ca})
	if err != nil {
		return nil, err
	}
	binLayer, err := layer(created, file{d.BinaryPath(), 0o755, bin})
	if err != nil {
		return nil, err
	}
	img, err := mutate.Append(empty.Image,
		mutate.Addendum{Layer: caLayer, History: v1.History{
			Created: v1.Time{Time: created}, CreatedBy: "COPY ca-certificates.crt " + CACertsPath,
			Comment: "ociimage: the build machine's CA bundle"}},
		mutate.Addendum{Layer: binLayer, History: v1.History{
			Created: v1.Time{Time: created}, CreatedBy: "COPY " + d.Name + " " + d.BinaryPath(),
			Comment: "ociimage: CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' " + d.Package}},
	)
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", opts.arch()
	cf.Created = v1.Time{Time: created}
	cf.Config = Config(d, opts)
	return mutate.ConfigFile(img, cf)
}

// Config is the image config of d: what a Dockerfile's ENTRYPOINT, CMD,
// USER, EXPOSE and LABEL say.
func Config(d Daemon, opts Options) v1.Config {
	ports := make(map[string]struct{}, len(d.Ports))
	for _, p := range d.Ports {
		ports[p] = struct{}{}
	}
	labels := map[string]string{
		"org.opencontainers.image.source": Source,
		"org.opencontainers.image.title":  d.Name,
	}
	if opts.Version != "" {
		labels["org.opencontainers.image.version"] = opts.Version
	}
	if opts.Revision != "" {
		labels["org.opencontainers.image.revision"] = opts.Revision
	}
	return v1.Config{
		Entrypoint:   d.Entrypoint(),
		Cmd:          d.Cmd,
		User:         User,
		ExposedPorts: ports,
		Labels:       labels,
	}
}

type file struct {
	path string
	mode int64
	data []byte
}

// layer is a gzipped tar of f and its parent directories, all owned by
// root, every timestamp at created: the same input gives the same bytes.
func layer(created time.Time, f file) (v1.Layer, error) {
	var tarBuf bytes.Buffer
	tw := tar.NewWriter(&tarBuf)
	rel := strings.TrimPrefix(f.path, "/")
	var dirs []string
	for d := path.Dir(rel); d != "."; d = path.Dir(d) {
		dirs = append([]string{d}, dirs...)
	}
	for _, d := range dirs {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755,
			ModTime: created, Format: tar.FormatPAX}); err != nil {
			return nil, err
		}
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: rel, Mode: f.mode, Size: int64(len(f.data)),
		ModTime: created, Format: tar.FormatPAX}); err != nil {
		return nil, err
	}
	if _, err := tw.Write(f.data); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	// Compressed here, once: gzip with no name and no time in its header.
	var gz bytes.Buffer
	zw, err := gzip.NewWriterLevel(&gz, gzip.BestCompression)
	if err != nil {
		return nil, err
	}
	if _, err := zw.Write(tarBuf.Bytes()); err != nil {
		return nil, err
	}
	if err := zw.Close(); err != nil {
		return nil, err
	}
	compressed := gz.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(compressed)), nil
	})
}

// Built is an image written to a tarball.
type Built struct {
	Daemon Daemon
	// Ref is the tag in the tarball's manifest.json (RepoTags).
	Ref string
	// Path is the tarball.
	Path string
	// Digest is the image's manifest digest: what `crane push` of the
	// tarball gives it in a registry.
	Digest v1.Hash
	// TarballSize is the tarball's size; LayersSize the compressed
	// layers' (what a registry stores and a node pulls).
	TarballSize, LayersSize int64
}

// Build builds d's binary in a temporary directory, its image, and writes
// the image as dir/<name>.tar tagged d.Ref(opts.Version).
func Build(ctx context.Context, d Daemon, opts Options, dir string) (*Built, error) {
	if opts.Version == "" {
		return nil, errors.New("no version to tag the image with")
	}
	tmp, err := os.MkdirTemp("", "ociimage-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	binary := filepath.Join(tmp, d.Name)
	if err := BuildBinary(ctx, d, opts, binary); err != nil {
		return nil, err
	}
	img, err := Image(d, binary, opts)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", d.Name, err)
	}
	ref := d.Ref(opts.Version)
	tag, err := name.NewTag(ref, name.StrictValidation)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	out := filepath.Join(dir, d.Name+".tar")
	if err := tarball.WriteToFile(out, tag, img); err != nil {
		return nil, fmt.Errorf("write %s: %w", out, err)
	}
	b := &Built{Daemon: d, Ref: ref, Path: out}
	if b.Digest, err = img.Digest(); err != nil {
		return nil, err
	}
	layers, err := img.Layers()
	if err != nil {
		return nil, err
	}
	for _, l := range layers {
		n, err := l.Size()
		if err != nil {
			return nil, err
		}
		b.LayersSize += n
	}
	st, err := os.Stat(out)
	if err != nil {
		return nil, err
	}
	b.TarballSize = st.Size()
	return b, nil
}
