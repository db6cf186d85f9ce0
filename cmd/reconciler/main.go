// Command reconciler relays its region's spends to NATS JetStream and
// applies the other regions' spends to its region's Redis Cluster.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/limiterd/limiterd/internal/logging"
	"github.com/limiterd/limiterd/internal/reconciler"
)

func main() { os.Exit(run()) }

func run() int {
	fs := flag.NewFlagSet("reconciler", flag.ContinueOnError)
	var opts reconciler.Options
	opts.RegisterFlags(fs)
	var logOpts logging.Options
	logOpts.RegisterFlags(fs)
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
		fmt.Fprintf(os.Stderr, "reconciler: unexpected arguments %q\n", fs.Args())
		return 2
	}
	logger, err := logging.New(os.Stderr, logOpts)
	if err != nil {
		fmt.Fprintln(os.Stderr, "reconciler:", err)
		return 2
	}
	opts.Logger = logger
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := reconciler.Run(ctx, opts); err != nil {
		logger.Error("reconciler failed", slog.Any("err", err))
		return 1
	}
	return 0
}
