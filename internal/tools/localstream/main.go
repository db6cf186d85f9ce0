// Command localstream makes the stream a region's limiterd flush their
// spends into, for a region without a reconciler: `make run`, one limiterd
// on the embedded store, beside a NATS server for the admin API. limiterd
// then publishes its spends (and an admin reset) as it does in a
// deployment, and nothing reads them. The stream keeps at most --max-age of
// them and --max-bytes, dropping the oldest. Where a reconciler runs it
// makes this stream itself, with its own limits: do not run this there.
//
//	go run ./internal/tools/localstream --nats.url nats://127.0.0.1:14222
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/pkg/gossip"
)

func main() { os.Exit(run(os.Args[1:])) }

func run(args []string) int {
	fs := flag.NewFlagSet("localstream", flag.ContinueOnError)
	url := fs.String("nats.url", "", "NATS server of the region (required)")
	region := fs.String("region", "local", "the region's name, as limiterd's --region")
	maxAge := fs.Duration("max-age", 10*time.Minute, "oldest spend message kept")
	maxBytes := fs.Int64("max-bytes", 64<<20, "most bytes of spend messages kept")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if err := ensure(*url, *region, *maxAge, *maxBytes); err != nil {
		fmt.Fprintln(os.Stderr, "localstream:", err)
		return 1
	}
	return 0
}

func ensure(url, region string, maxAge time.Duration, maxBytes int64) error {
	var errs []error
	if url == "" {
		errs = append(errs, errors.New("--nats.url: required"))
	}
	if region == "" {
		errs = append(errs, errors.New("--region: required"))
	}
	if maxAge <= 0 {
		errs = append(errs, fmt.Errorf("--max-age: %v is not above 0", maxAge))
	}
	if maxBytes <= 0 {
		errs = append(errs, fmt.Errorf("--max-bytes: %d is not above 0", maxBytes))
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	nc, err := nats.Connect(url, nats.Name("localstream "+region))
	if err != nil {
		return fmt.Errorf("--nats.url %s: %w", url, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fmt.Errorf("--nats.url %s: %w", url, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = natsconn.EnsureStream(ctx, js, jetstream.StreamConfig{
		Name:      gossip.LocalStream(region),
		Subjects:  []string{gossip.LocalSubject(region)},
		Retention: jetstream.LimitsPolicy,
		MaxAge:    maxAge,
		MaxBytes:  maxBytes,
		Discard:   jetstream.DiscardOld,
		Storage:   jetstream.FileStorage,
	})
	return err
}
