// Command limiterbench sends load to limiterd over gRPC and reports
// throughput, latency, decisions, errors and admission accuracy.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/limiterd/limiterd/internal/loadgen"
	"github.com/limiterd/limiterd/lua"
)

type options struct {
	load        loadgen.Options
	json        bool
	printScript string
}

func main() { os.Exit(run()) }

func run() int {
	opts := options{load: loadgen.DefaultOptions()}
	fs := flag.NewFlagSet("limiterbench", flag.ContinueOnError)
	opts.load.RegisterFlags(fs)
	fs.BoolVar(&opts.json, "json", false, "print the result as JSON instead of a table")
	fs.StringVar(&opts.printScript, "print-script", "", "print limiterd's Lua script of this algorithm (for redis-benchmark) and exit")
	// Usage goes to stdout when asked for (exit 0), to stderr with the
	// error of a bad flag (exit 2).
	var usage bytes.Buffer
	fs.SetOutput(&usage)
	if err := fs.Parse(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Stdout.Write(usage.Bytes())
			return 0
		}
		os.Stderr.Write(usage.Bytes())
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "limiterbench: unexpected argument %q\n", fs.Arg(0))
		return 2
	}
	if opts.printScript != "" {
		src, err := lua.Single(opts.printScript, lua.StoreClock)
		if err != nil {
			fmt.Fprintf(os.Stderr, "limiterbench: --print-script: %v\n", err)
			return 2
		}
		fmt.Print(src)
		return 0
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
