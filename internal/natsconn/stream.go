// Package natsconn is the NATS plumbing both daemons share: streams and
// key-value buckets that are created when missing and left alone when they
// already have the wanted configuration.
package natsconn

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/nats-io/nats.go/jetstream"
)

// EnsureStream returns the stream cfg.Name, creating it when it is missing
// and updating it only when one of the settings cfg gives differs from the
// stream's. Every daemon of every region calls it at start-up: a stream
// whose configuration already matches is not rewritten, so concurrent
// starts do not race one another's updates on the server.
func EnsureStream(ctx context.Context, js jetstream.JetStream, cfg jetstream.StreamConfig) (jetstream.Stream, error) {
	s, err := js.Stream(ctx, cfg.Name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		if s, err = js.CreateStream(ctx, cfg); err == nil {
			return s, nil
		}
		if !errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			return nil, fmt.Errorf("create stream %s: %w", cfg.Name, err)
		}
		// Another daemon created it meanwhile: compare with that one.
		s, err = js.Stream(ctx, cfg.Name)
	}
	if err != nil {
		return nil, fmt.Errorf("stream %s: %w", cfg.Name, err)
	}
	if StreamMatches(s.CachedInfo().Config, cfg) {
		return s, nil
	}
	s, err = js.UpdateStream(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("update stream %s: %w", cfg.Name, err)
	}
	return s, nil
}

// StreamMatches reports whether have, a stream's configuration as the
// server reports it (with its defaults filled in), already has every
// setting that want gives; settings want leaves at their zero value are
// not compared.
func StreamMatches(have, want jetstream.StreamConfig) bool {
	replicas := max(want.Replicas, 1)
	return slices.Equal(have.Subjects, want.Subjects) &&
		have.Retention == want.Retention &&
		have.Storage == want.Storage &&
		have.Discard == want.Discard &&
		have.Replicas == replicas &&
		(want.MaxAge == 0 || have.MaxAge == want.MaxAge) &&
		(want.MaxBytes == 0 || have.MaxBytes == want.MaxBytes) &&
		(want.MaxMsgSize == 0 || have.MaxMsgSize == want.MaxMsgSize) &&
		(want.Duplicates == 0 || have.Duplicates == want.Duplicates) &&
		(want.Description == "" || have.Description == want.Description) &&
		(want.Placement == nil || (have.Placement != nil && have.Placement.Cluster == want.Placement.Cluster)) &&
		sameSources(have.Sources, want.Sources)
}

// EnsureKeyValue returns the key-value bucket cfg.Bucket, creating it when
// it is missing. An existing bucket is used as it is: its history and
// limits are the operator's to change.
func EnsureKeyValue(ctx context.Context, js jetstream.JetStream, cfg jetstream.KeyValueConfig) (jetstream.KeyValue, error) {
	kv, err := js.KeyValue(ctx, cfg.Bucket)
	if err == nil {
		return kv, nil
	}
	if !errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("key-value bucket %s: %w", cfg.Bucket, err)
	}
	kv, err = js.CreateKeyValue(ctx, cfg)
	if errors.Is(err, jetstream.ErrBucketExists) {
		return js.KeyValue(ctx, cfg.Bucket)
	}
	if err != nil {
		return nil, fmt.Errorf("create key-value bucket %s: %w", cfg.Bucket, err)
	}
	return kv, nil
}

// sameSources reports whether two streams source the same streams with the
// same filters; where each started (OptStartTime, OptStartSeq) is not
// compared, since a stream's start is set once, when it is made.
func sameSources(have, want []*jetstream.StreamSource) bool {
	key := func(s *jetstream.StreamSource) string { return s.Name + " " + s.FilterSubject }
	a := make([]string, 0, len(have))
	for _, s := range have {
		a = append(a, key(s))
	}
	b := make([]string, 0, len(want))
	for _, s := range want {
		b = append(b, key(s))
	}
	slices.Sort(a)
	slices.Sort(b)
	return slices.Equal(a, b)
}
