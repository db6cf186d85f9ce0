// Package streamsrc follows the sources of a region's inbound stream, one
// per other region's spends stream: where a new one starts
// (FirstSeqSince), and a watch that resets those stalled (Watcher).
//
// nats-server (v2.15) sources each other region's spends stream through a
// consumer it makes on that stream, which sends a heartbeat every second
// when there is nothing to deliver. When making that consumer fails (the
// other region cut off, or its spends stream not made yet), the server
// tries again after 10 s × the failures so far, up to 2 minutes
// (calculateRetryBackoff in stream.go), and nothing shortens the wait when
// the other region comes back: the spends then wait in its stream for up
// to two minutes after a partition heals, and each region enforces a
// reconciled rule's full limit alone meanwhile.
//
// So each reconciler reads the inbound stream's source info every
// interval (Watcher.Run). A source not heard of (no message, no
// heartbeat) for SourceStallThreshold, or reporting an error, is stalled;
// while it is, the reconciler asks the source region's spends stream for its info (only the
// stream's leader answers it, so an answer means the source region is
// reachable), and when it answers resets the source: one stream update
// that removes it and a second that adds it back, as the server has it.
// The server then forgets the source's failures and sets it up again at
// once, from the sequence after the last message of it the stream holds
// (its index of sourced sequences, rebuilt from the stream's messages when
// a source is added), so nothing is sourced twice or skipped; the other
// sources are not touched.
package streamsrc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/limiterd/limiterd/pkg/gossip"
)

const (
	// SourceStallThreshold is how long the inbound stream may go without
	// hearing of a source before it is stalled: five of the heartbeats a
	// healthy source sends every second (nats-server's sourceHealthHB),
	// half the server's own health check (10 s).
	SourceStallThreshold = 5 * time.Second
	// sourceResetEvery and sourceResetJitter space the resets of one
	// source by one reconciler: at least 10 s apart, and up to 5 s more,
	// drawn each time, so that a region's reconcilers, all running this
	// loop, rarely reset it together (which is harmless: the second
	// finds the source set up again, or does the same once more).
	sourceResetEvery  = 10 * time.Second
	sourceResetJitter = 5 * time.Second
	// sourceProbeEvery is how often the spends stream of a stalled source
	// is asked whether it answers; callTimeout bounds each call.
	sourceProbeEvery = time.Second
	// callTimeout bounds each call to the server.
	callTimeout = 2 * time.Second
)

// Watcher watches the sources of one region's inbound stream. Its
// fields are set before Run, and not changed after.
type Watcher struct {
	JS jetstream.JetStream
	// Region is the region whose inbound stream is watched.
	Region string
	Log    *slog.Logger
	// Active, Stalls and Resets are the series, by source_region, of how
	// long since a source was heard of, of the stalls seen and of the
	// resets made.
	Active         *prometheus.GaugeVec
	Stalls, Resets *prometheus.CounterVec
	// Regions are the source regions to watch now.
	Regions func() []string
	// Unknown is called when a source never seen here is missing from
	// the inbound stream: the set-up adds it, as at a topology switch.
	Unknown func()
}

// FirstSeqSince is the sequence of the first message, on any subject, that
// the stream name stored at or after t (a JetStream message get by start
// time, which nats.go's jetstream package does not offer; a source
// filtered to some of the subjects starts there all the same): 1 when the
// server answers that the stream does not exist (everything it will hold
// comes after t), the sequence after its last when it holds none since t.
// ok is false when the server does not answer in time, or refuses.
func FirstSeqSince(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, name string, t time.Time) (seq uint64, ok bool) {
	ctx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	// The state is read first: a message stored after it and found
	// nothing since t came after the get, so after t (but for the clocks'
	// skew between regions, which makes a source start early, never late).
	st, err := js.Stream(ctx, name)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return 1, true
	}
	if err != nil {
		return 0, false
	}
	last := st.CachedInfo().State.LastSeq
	req, err := json.Marshal(struct {
		StartTime time.Time `json:"start_time"`
		NextFor   string    `json:"next_by_subj,omitempty"`
		NoHeaders bool      `json:"no_hdr"`
	}{t.UTC(), ">", true})
	if err != nil {
		return 0, false
	}
	msg, err := nc.RequestWithContext(ctx, "$JS.API.STREAM.MSG.GET."+name, req)
	if err != nil {
		return 0, false
	}
	var resp struct {
		Error   *jetstream.APIError `json:"error"`
		Message *struct {
			Seq uint64 `json:"seq"`
		} `json:"message"`
	}
	if err := json.Unmarshal(msg.Data, &resp); err != nil {
		return 0, false
	}
	switch {
	case resp.Error != nil && resp.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound:
		return last + 1, true
	case resp.Error != nil, resp.Message == nil || resp.Message.Seq == 0:
		return 0, false
	}
	return resp.Message.Seq, true
}

// sourceState is what Run knows of one source.
type sourceState struct {
	// cfg is the source as the server last had it.
	cfg *jetstream.StreamSource
	// unheard is when the source was first seen not heard of since its
	// set-up (Active -1), zero when it has been heard of since.
	unheard time.Time
	// stalled is when the source was last heard of, once it is seen
	// stalled; zero while it is not.
	stalled   time.Time
	lastErr   string
	nextProbe time.Time
	nextReset time.Time
	// missing is when the source was first seen missing from the
	// inbound stream's configuration (a reset stopped between its two
	// updates), zero while it is there.
	missing time.Time
}

// Run watches the inbound stream's sources every interval, and resets
// those stalled whose spends stream answers, until ctx ends.
func (w *Watcher) Run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	states := map[string]*sourceState{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		w.checkSources(ctx, states)
	}
}

// checkSources is one round of Run.
func (w *Watcher) checkSources(ctx context.Context, states map[string]*sourceState) {
	in := gossip.InStream(w.Region)
	ictx, cancel := context.WithTimeout(ctx, callTimeout)
	stream, err := w.JS.Stream(ictx, in)
	cancel()
	if err != nil {
		return // the reconciler's backlog loop sees a stream gone
	}
	info := stream.CachedInfo()
	now := time.Now()
	for _, name := range w.Regions() {
		s := states[name]
		if s == nil {
			s = &sourceState{}
			states[name] = s
		}
		var quiet time.Duration
		si, cfg := SourceOf(info, name)
		switch {
		case cfg == nil:
			w.sourceMissing(ctx, name, s, now)
		case si == nil:
			s.cfg, s.missing = cfg, time.Time{} // not led by a server that reports it yet
		default:
			s.cfg, s.missing = cfg, time.Time{}
			quiet = w.checkSource(ctx, name, si, s, now)
		}
		w.Active.WithLabelValues(name).Set(quiet.Seconds())
	}
}

// SourceOf is the info and the configuration of the source of region's
// spends stream (filtered to its partitions' subjects) in info.
func SourceOf(info *jetstream.StreamInfo, region string) (*jetstream.StreamSourceInfo, *jetstream.StreamSource) {
	stream, filter := gossip.RegionStream(region), gossip.PartitionSubjects(region)
	var si *jetstream.StreamSourceInfo
	for _, x := range info.Sources {
		if x.Name == stream && x.FilterSubject == filter {
			si = x
		}
	}
	i := slices.IndexFunc(info.Config.Sources, func(c *jetstream.StreamSource) bool { return c.Name == stream && c.FilterSubject == filter })
	if i < 0 {
		return si, nil
	}
	return si, info.Config.Sources[i]
}

// checkSource updates one source's state, and resets it when it is
// stalled, due and its spends stream answers. It returns how long since
// the source was heard of.
func (w *Watcher) checkSource(ctx context.Context, name string, si *jetstream.StreamSourceInfo, s *sourceState, now time.Time) time.Duration {
	// How long since the source was heard of: when it has not been since
	// its set-up, since this reconciler saw it so (or saw it stalled).
	quiet := si.Active
	if quiet < 0 {
		if s.unheard.IsZero() {
			s.unheard = now
		}
		from := s.unheard
		if !s.stalled.IsZero() && s.stalled.Before(from) {
			from = s.stalled
		}
		quiet = now.Sub(from)
	} else {
		s.unheard = time.Time{}
	}
	var serverErr string
	if si.Error != nil {
		serverErr = si.Error.Error()
	}
	if serverErr != "" {
		s.lastErr = serverErr
	}
	heard := si.Active >= 0 && si.Active <= SourceStallThreshold
	if !s.stalled.IsZero() {
		if heard && serverErr == "" {
			w.Log.Info("stream source heard of again", "source", name, "stalled_for", now.Add(-si.Active).Sub(s.stalled).Round(time.Millisecond))
			*s = sourceState{cfg: s.cfg}
			return quiet
		}
	} else {
		if serverErr == "" && quiet <= SourceStallThreshold {
			return quiet
		}
		s.stalled = now.Add(-quiet)
		s.lastErr = serverErr
		// The first reset waits up to one probe, drawn, so that the
		// region's reconcilers do not all reset it in the same round.
		s.nextReset = now.Add(rand.N(sourceProbeEvery))
		w.Stalls.WithLabelValues(name).Inc()
		w.Log.Warn("stream source stalled", "source", name, "quiet", quiet.Round(time.Millisecond), "server_error", serverErr)
	}
	if now.Before(s.nextProbe) || now.Before(s.nextReset) {
		return quiet
	}
	s.nextProbe = now.Add(sourceProbeEvery)
	pctx, cancel := context.WithTimeout(ctx, callTimeout)
	spends, err := w.JS.Stream(pctx, gossip.RegionStream(name))
	cancel()
	if err != nil {
		return quiet // not reachable yet, or not made yet
	}
	s.nextReset = now.Add(sourceResetEvery + rand.N(sourceResetJitter))
	stalledFor := now.Sub(s.stalled).Round(time.Millisecond)
	if err := w.resetSource(ctx, s.cfg, spends.CachedInfo().State); err != nil {
		w.Log.Warn("stream source not reset, will retry", "source", name, "stalled_for", stalledFor, "err", err)
		return quiet
	}
	w.Resets.WithLabelValues(name).Inc()
	w.Log.Warn("stream source reset: its spends stream answers, the server was backing off", "source", name,
		"stalled_for", stalledFor, "server_error", s.lastErr)
	return quiet
}

// sourceMissing adds back a source found missing from the inbound
// stream's configuration on two rounds at least a probe apart: a reset
// (this reconciler's or another's) stopped between its two updates, or
// one that read the configuration before a reconciler's set-up added the
// source wrote it back without it.
func (w *Watcher) sourceMissing(ctx context.Context, name string, s *sourceState, now time.Time) {
	if s.missing.IsZero() {
		s.missing = now
		return
	}
	if now.Sub(s.missing) < sourceProbeEvery {
		return
	}
	if s.cfg == nil {
		// Never seen here: the set-up adds it, as at a switch of the
		// topology.
		s.missing = time.Time{}
		w.Unknown()
		return
	}
	actx, cancel := context.WithTimeout(ctx, callTimeout)
	defer cancel()
	if err := w.addSource(actx, s.cfg); err != nil {
		w.Log.Warn("stream source missing, not added back, will retry", "source", name, "err", err)
		return
	}
	w.Log.Warn("stream source was missing, added back", "source", name)
	s.missing = time.Time{}
}

// resetSource makes the server set src up again at once: one update of the
// inbound stream without it, a second with it back. The other sources and
// settings are written back as the server has them. spends is the state
// of src's stream, read just before.
//
// The server sets a source added to a stream up from the sequence after
// the last message of it the stream holds. When the stream holds none, it
// goes by the source's start time, but from the stream's last message
// instead when that is later (trySetupSourceConsumer), which would skip
// what src's stream got meanwhile; so a source sourced from a time whose
// stream holds nothing older than that time comes back sourced from its
// stream's first sequence.
func (w *Watcher) resetSource(ctx context.Context, src *jetstream.StreamSource, spends jetstream.StreamState) error {
	ctx, cancel := context.WithTimeout(ctx, 3*callTimeout)
	defer cancel()
	in := gossip.InStream(w.Region)
	stream, err := w.JS.Stream(ctx, in)
	if err != nil {
		return fmt.Errorf("stream %s: %w", in, err)
	}
	info, err := stream.Info(ctx, jetstream.WithSubjectFilter(src.FilterSubject))
	if err != nil {
		return fmt.Errorf("stream %s: %w", in, err)
	}
	if src.OptStartTime != nil && info.State.Subjects[src.FilterSubject] == 0 &&
		(spends.Msgs == 0 || !spends.FirstTime.Before(*src.OptStartTime)) {
		back := *src
		back.OptStartTime, back.OptStartSeq = nil, max(spends.FirstSeq, 1)
		if spends.Msgs == 0 {
			back.OptStartSeq = spends.LastSeq + 1
		}
		src = &back
	}
	cfg := info.Config
	i := slices.IndexFunc(cfg.Sources, func(c *jetstream.StreamSource) bool { return sameSource(c, src) })
	if i >= 0 {
		cfg.Sources = slices.Delete(slices.Clone(cfg.Sources), i, i+1)
		if _, err := w.JS.UpdateStream(ctx, cfg); err != nil {
			return fmt.Errorf("update stream %s without source %s: %w", in, src.Name, err)
		}
	}
	return w.addSource(ctx, src)
}

// addSource adds src to the inbound stream unless it is there.
func (w *Watcher) addSource(ctx context.Context, src *jetstream.StreamSource) error {
	in := gossip.InStream(w.Region)
	stream, err := w.JS.Stream(ctx, in)
	if err != nil {
		return fmt.Errorf("stream %s: %w", in, err)
	}
	cfg := stream.CachedInfo().Config
	if slices.ContainsFunc(cfg.Sources, func(c *jetstream.StreamSource) bool { return sameSource(c, src) }) {
		return nil // another reconciler added it back
	}
	cfg.Sources = append(slices.Clone(cfg.Sources), src)
	if _, err := w.JS.UpdateStream(ctx, cfg); err != nil {
		return fmt.Errorf("update stream %s with source %s: %w", in, src.Name, err)
	}
	return nil
}

func sameSource(a, b *jetstream.StreamSource) bool {
	return a.Name == b.Name && a.FilterSubject == b.FilterSubject
}
