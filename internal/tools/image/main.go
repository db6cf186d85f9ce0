// Command image builds the container images of limiterd and the
// reconciler without a Docker daemon (package internal/ociimage) and writes
// them as tarballs that `docker load -i` and `crane push` accept. `make
// image` runs it from the module root:
//
//	go run ./internal/tools/image --dir bin/images
//
// Every timestamp in the images is the commit's time (SOURCE_DATE_EPOCH,
// when set, instead), so two builds of one commit have the same digest.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/limiterd/limiterd/internal/ociimage"
)

func main() { os.Exit(run(os.Args[1:])) }

func run(args []string) int {
	fs := flag.NewFlagSet("image", flag.ContinueOnError)
	dir := fs.String("dir", "bin/images", "directory to write <name>.tar into")
	arch := os.Getenv("GOARCH")
	if arch == "" {
		arch = ociimage.DefaultArch
	}
	fs.StringVar(&arch, "arch", arch, "architecture of the binaries and images (default: $GOARCH, else "+ociimage.DefaultArch+")")
	version := fs.String("version", "", "image tag and version label (default: the file "+ociimage.VersionFile+")")
	caCerts := fs.String("ca-certs", ociimage.CACertsPath, "CA bundle to copy into the images")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := build(ctx, *dir, arch, *version, *caCerts); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		return 1
	}
	return 0
}

func build(ctx context.Context, dir, arch, version, caCerts string) error {
	if version == "" {
		v, err := ociimage.ReadVersion(".")
		if err != nil {
			return fmt.Errorf("--version: %w", err)
		}
		version = v
	}
	rev, created := ociimage.GitInfo(ctx, ".")
	if s := os.Getenv("SOURCE_DATE_EPOCH"); s != "" {
		sec, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return fmt.Errorf("SOURCE_DATE_EPOCH %q: %w", s, err)
		}
		created = time.Unix(sec, 0).UTC()
	}
	daemons, err := ociimage.Daemons()
	if err != nil {
		return err
	}
	opts := ociimage.Options{Version: version, Revision: rev, Created: created, Arch: arch, CACertsFile: caCerts}
	for _, d := range daemons {
		b, err := ociimage.Build(ctx, d, opts, dir)
		if err != nil {
			return err
		}
		fmt.Printf("%s  %s  linux/%s  %s  %.1f MB (layers %.1f MB)\n",
			b.Path, b.Ref, arch, b.Digest, float64(b.TarballSize)/1e6, float64(b.LayersSize)/1e6)
	}
	return nil
}
