// Command limiterdemo drives one fresh key through the three regions of the local
// stack (make up) well above its limit, on a reconciled rule and then on the
// same limits unreconciled, and prints how far each went past the limit.
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

	"github.com/limiterd/limiterd/internal/demo"
)

func main() { os.Exit(run()) }

func run() int {
	fs := flag.NewFlagSet("limiterdemo", flag.ContinueOnError)
	opts := demo.DefaultOptions()
	opts.RegisterFlags(fs)
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
		fmt.Fprintf(os.Stderr, "limiterdemo: unexpected arguments %q\n", fs.Args())
		return 2
	}
	if err := opts.Validate(); err != nil {
		fmt.Fprintln(os.Stderr, "limiterdemo:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := demo.Run(ctx, opts, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "limiterdemo:", err)
		return 1
	}
	return 0
}
