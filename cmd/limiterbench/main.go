// Command limiterbench sends load to limiterd over gRPC and reports
// throughput, latency, decisions, errors and admission accuracy.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/limiterd/limiterd/internal/loadgen"
)

type options struct {
	load loadgen.Options
	json bool
}

func main() { os.Exit(run()) }

func run() int {
	opts := options{load: loadgen.DefaultOptions()}
	fs := flag.NewFlagSet("limiterbench", flag.ContinueOnError)
	opts.load.RegisterFlags(fs)
	fs.BoolVar(&opts.json, "json", false, "print the result as JSON instead of a table")
	if err := fs.Parse(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "limiterbench: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	if err := opts.load.Validate(); err != nil {
		fmt.Fprintf(os.Stderr, "limiterbench: %v\n", err)
		return 2
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	res, err := loadgen.Run(ctx, opts.load)
	if err != nil {
		fmt.Fprintf(os.Stderr, "limiterbench: %v\n", err)
		return 1
	}
	if opts.json {
		err = res.WriteJSON(os.Stdout)
	} else {
		err = res.WriteTable(os.Stdout)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "limiterbench: write result: %v\n", err)
		return 1
	}
	if res.Interrupted {
		return 130
	}
	return 0
}
