// Command natsauth writes the NATS identities of a deployment into a
// directory: auth.conf, the nats-server authorization block with each
// identity's permissions (include it from the server's configuration), and
// each identity's nkey seed, <name>.nk (mode 0600), for the daemons'
// --nats.nkey-seed-file and --admin.nats-nkey-seed-file. scripts/stack.sh
// runs it for `make up`.
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
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if err := write(*regions, *dir); err != nil {
		fmt.Fprintln(os.Stderr, "natsauth:", err)
		return 1
	}
	return 0
}

func write(regions, dir string) error {
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
	ids, err := natsauth.Write(dir, strings.Split(regions, ","))
	if err != nil {
		return fmt.Errorf("--regions %s --dir %s: %w", regions, dir, err)
	}
	for _, id := range ids {
		fmt.Printf("%s %s\n", id.Name, natsauth.SeedFile(dir, id.Name))
	}
	return nil
}
