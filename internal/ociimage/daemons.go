// Package ociimage builds the container images of limiterd and the
// reconciler without a Docker daemon: a static binary on an empty base,
// with the CA bundle as a layer of its own, written as docker-save style
// tarballs that `docker load` and `crane push` accept. Builds of one
// commit are byte for byte the same.
package ociimage

import (
	"flag"
	"fmt"
	"net"
	"slices"
	"strings"

	"github.com/limiterd/limiterd/internal/limiterd"
	"github.com/limiterd/limiterd/internal/reconciler"
)

// Where the images are published and what they are built from.
const (
	// Registry is the image repositories' prefix: the GitHub organisation
	// of the module github.com/limiterd/limiterd on ghcr.io.
	Registry = "ghcr.io/limiterd"
	// Source is the org.opencontainers.image.source label.
	Source = "https://github.com/limiterd/limiterd"
	// User runs the daemons: distroless's nonroot, the runAsUser and
	// fsGroup of deploy/k8s/base.
	User = "65532:65532"
	// BinDir holds the binary in the image.
	BinDir = "/usr/local/bin"
	// CACertsPath is where the CA bundle goes, Debian's path (Go's
	// crypto/x509 looks there first on Linux).
	CACertsPath = "/etc/ssl/certs/ca-certificates.crt"
)

// Daemon is one image to build.
type Daemon struct {
	// Name is the command's and the image repository's name.
	Name string
	// Package is the main package to build, relative to the module root.
	Package string
	// Ports are the default ports of its listen-address flags, as
	// "8081/tcp", in the order the flags sort.
	Ports []string
	// Cmd are the image's default arguments: every listen address of the
	// flags with a default, on all interfaces, since a default of
	// 127.0.0.1 is out of reach from outside a container.
	Cmd []string
}

// Entrypoint is the image's entrypoint: the binary alone, no shell.
func (d Daemon) Entrypoint() []string { return []string{d.BinaryPath()} }

// BinaryPath is the binary's absolute path in the image.
func (d Daemon) BinaryPath() string { return BinDir + "/" + d.Name }

// Repository is the image's name without a tag.
func (d Daemon) Repository() string { return Registry + "/" + d.Name }

// Ref is the image's name tagged with version.
func (d Daemon) Ref(version string) string { return d.Repository() + ":" + version }

// Daemons are limiterd and the reconciler, with the ports read from their
// flag sets' defaults.
func Daemons() ([]Daemon, error) {
	var lo limiterd.Options
	lfs := flag.NewFlagSet("limiterd", flag.ContinueOnError)
	lo.RegisterFlags(lfs)
	var ro reconciler.Options
	rfs := flag.NewFlagSet("reconciler", flag.ContinueOnError)
	ro.RegisterFlags(rfs)

	var out []Daemon
	for _, d := range []struct {
		name string
		fs   *flag.FlagSet
	}{{"limiterd", lfs}, {"reconciler", rfs}} {
		daemon := Daemon{Name: d.name, Package: "./cmd/" + d.name}
		var err error
		daemon.Ports, daemon.Cmd, err = listenPorts(d.fs)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", d.name, err)
		}
		if len(daemon.Ports) == 0 {
			return nil, fmt.Errorf("%s: no listen-address flag has a default port", d.name)
		}
		out = append(out, daemon)
	}
	return out, nil
}

// listenPorts reads the flags named *.listen-address whose default is set
// (one that is off by default, such as --forward-auth.listen-address,
// opens no port).
func listenPorts(fs *flag.FlagSet) (ports, cmd []string, err error) {
	fs.VisitAll(func(f *flag.Flag) {
		if !strings.HasSuffix(f.Name, ".listen-address") || f.DefValue == "" || err != nil {
			return
		}
		_, port, serr := net.SplitHostPort(f.DefValue)
		if serr != nil {
			err = fmt.Errorf("--%s default %q: %w", f.Name, f.DefValue, serr)
			return
		}
		ports = append(ports, port+"/tcp")
		cmd = append(cmd, "--"+f.Name+"=:"+port)
	})
	if slices.Contains(ports, "0/tcp") {
		return nil, nil, fmt.Errorf("a listen address defaults to port 0: %q", ports)
	}
	return ports, cmd, err
}
