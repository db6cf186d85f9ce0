// Command natsauth writes the NATS identities of a deployment into a
// directory: auth.conf, the nats-server authorization block with each
// identity's permissions (include it from the server's configuration), and
// each identity's nkey seed, <name>.nk (mode 0600), for the daemons'
// --nats.nkey-seed-file and --admin.nats-nkey-seed-file. scripts/stack.sh
// runs it for `make up`.
//
// A seed already in the directory is kept (so adding a region gives new
// seeds to its identities only); --rotate makes new ones for every
// identity. Each line it prints names an identity, its seed file, and
// whether the seed is new or kept.
//
//	go run ./internal/tools/natsauth --regions us-east,eu-west --dir .stack/nats/auth
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/limiterd/limiterd/internal/natsauth"
)

func main() { os.Exit(run(os.Args[1:])) }

func run(args []string) int {
	fs := flag.NewFlagSet("natsauth", flag.ContinueOnError)
	regions := fs.String("regions", "", "comma-separated region names (required)")
	dir := fs.String("dir", "", "directory to write auth.conf and the seed files into (required)")
	rotate := fs.Bool("rotate", false, "make new seeds for every identity, also those whose seed file is in --dir")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if err := write(*regions, *dir, *rotate); err != nil {
		fmt.Fprintln(os.Stderr, "natsauth:", err)
		return 1
	}
	return 0
}

func write(regions, dir string, rotate bool) error {
	var errs []error
	if regions == "" {
		errs = append(errs, errors.New("--regions: required"))
	}
	if dir == "" {
		errs = append(errs, errors.New("--dir: required"))
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	var opts []natsauth.WriteOption
	if rotate {
		opts = append(opts, natsauth.Rotate())
	}
	ids, err := natsauth.Write(dir, strings.Split(regions, ","), opts...)
	if err != nil {
		return fmt.Errorf("--regions %s --dir %s: %w", regions, dir, err)
	}
	for _, id := range ids {
		state := "new"
		if id.Kept {
			state = "kept"
		}
		fmt.Printf("%s %s %s\n", id.Name, natsauth.SeedFile(dir, id.Name), state)
	}
	return nil
}
