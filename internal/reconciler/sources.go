package reconciler

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/limiterd/limiterd/pkg/gossip"
)

// The inbound stream's sources, watched, and reset when stalled.
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
// interval. A source not heard of (no message, no heartbeat) for
// SourceStallThreshold, or reporting an error, is stalled; while it is, the
// reconciler asks the source region's spends stream for its info (only the
// stream's leader answers it, so an answer means the source region is
// reachable), and when it answers resets the source: one stream update
// that removes it and a second that adds it back, as the server has it.
// The server then forgets the source's failures and sets it up again at
// once, from the sequence after the last message of it the stream holds
// (its index of sourced sequences, rebuilt from the stream's messages when
// a source is added), so nothing is sourced twice or skipped; the other
// sources are not touched.
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
	// is asked whether it answers; sourceCallTimeout bounds each call.
	sourceProbeEvery  = time.Second
	sourceCallTimeout = 2 * time.Second
)

// sourceState is what sourceLoop knows of one source.
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

// sourceLoop watches the inbound stream's sources every interval and
// resets those stalled whose spends stream answers.
func (r *Reconciler) sourceLoop(ctx context.Context, st *streams) {
	t := time.NewTicker(r.opts.Interval)
	defer t.Stop()
	states := map[string]*sourceState{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r.checkSources(ctx, st, states)
	}
}

// checkSources is one round of sourceLoop.
func (r *Reconciler) checkSources(ctx context.Context, st *streams, states map[string]*sourceState) {
	in := gossip.InStream(r.opts.Region)
	ictx, cancel := context.WithTimeout(ctx, sourceCallTimeout)
	stream, err := r.js.Stream(ictx, in)
	cancel()
	if err != nil {
		return // backlogLoop sees a stream gone
	}
	info := stream.CachedInfo()
	now := time.Now()
	for _, src := range st.current() {
		name := src.name
		// Two sources per region (its partitions, and its unpartitioned
		// spends of earlier releases), watched alike; the gauge is the
		// longer quiet.
		var quiet time.Duration
		for _, filter := range []string{gossip.RelaySubject(name), gossip.PartitionSubjects(name)} {
			s := states[filter]
			if s == nil {
				s = &sourceState{}
				states[filter] = s
			}
			si, cfg := sourceOf(info, name, filter)
			if cfg == nil {
				r.sourceMissing(ctx, name, s, now)
				continue
			}
			s.cfg, s.missing = cfg, time.Time{}
			if si == nil {
				continue // not led by a server that reports it yet
			}
			quiet = max(quiet, r.checkSource(ctx, name, si, s, now))
		}
		r.m.sourceActive.WithLabelValues(name).Set(quiet.Seconds())
	}
}

// sourceOf is the info and the configuration of the source of region's
// spends stream filtered to filter in info.
func sourceOf(info *jetstream.StreamInfo, region, filter string) (*jetstream.StreamSourceInfo, *jetstream.StreamSource) {
	stream := gossip.RegionStream(region)
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
func (r *Reconciler) checkSource(ctx context.Context, name string, si *jetstream.StreamSourceInfo, s *sourceState, now time.Time) time.Duration {
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
			r.log.Info("stream source heard of again", "source", name, "stalled_for", now.Add(-si.Active).Sub(s.stalled).Round(time.Millisecond))
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
		r.m.sourceStalls.WithLabelValues(name).Inc()
		r.log.Warn("stream source stalled", "source", name, "quiet", quiet.Round(time.Millisecond), "server_error", serverErr)
	}
	if now.Before(s.nextProbe) || now.Before(s.nextReset) {
		return quiet
	}
	s.nextProbe = now.Add(sourceProbeEvery)
	pctx, cancel := context.WithTimeout(ctx, sourceCallTimeout)
	spends, err := r.js.Stream(pctx, gossip.RegionStream(name))
	cancel()
	if err != nil {
		return quiet // not reachable yet, or not made yet
	}
	s.nextReset = now.Add(sourceResetEvery + rand.N(sourceResetJitter))
	stalledFor := now.Sub(s.stalled).Round(time.Millisecond)
	if err := r.resetSource(ctx, s.cfg, spends.CachedInfo().State); err != nil {
		r.log.Warn("stream source not reset, will retry", "source", name, "stalled_for", stalledFor, "err", err)
		return quiet
	}
	r.m.sourceResets.WithLabelValues(name).Inc()
	r.log.Warn("stream source reset: its spends stream answers, the server was backing off", "source", name,
		"stalled_for", stalledFor, "server_error", s.lastErr)
	return quiet
}

// sourceMissing adds back a source found missing from the inbound
// stream's configuration on two rounds at least a probe apart: a reset
// (this reconciler's or another's) stopped between its two updates, or
// one that read the configuration before a reconciler's set-up added the
// source wrote it back without it.
func (r *Reconciler) sourceMissing(ctx context.Context, name string, s *sourceState, now time.Time) {
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
		select {
		case r.topoChanged <- struct{}{}:
		default:
		}
		return
	}
	actx, cancel := context.WithTimeout(ctx, sourceCallTimeout)
	defer cancel()
	if err := r.addSource(actx, s.cfg); err != nil {
		r.log.Warn("stream source missing, not added back, will retry", "source", name, "err", err)
		return
	}
	r.log.Warn("stream source was missing, added back", "source", name)
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
func (r *Reconciler) resetSource(ctx context.Context, src *jetstream.StreamSource, spends jetstream.StreamState) error {
	ctx, cancel := context.WithTimeout(ctx, 3*sourceCallTimeout)
	defer cancel()
	in := gossip.InStream(r.opts.Region)
	stream, err := r.js.Stream(ctx, in)
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
		if _, err := r.js.UpdateStream(ctx, cfg); err != nil {
			return fmt.Errorf("update stream %s without source %s: %w", in, src.Name, err)
		}
	}
	return r.addSource(ctx, src)
}

// addSource adds src to the inbound stream unless it is there.
func (r *Reconciler) addSource(ctx context.Context, src *jetstream.StreamSource) error {
	in := gossip.InStream(r.opts.Region)
	stream, err := r.js.Stream(ctx, in)
	if err != nil {
		return fmt.Errorf("stream %s: %w", in, err)
	}
	cfg := stream.CachedInfo().Config
	if slices.ContainsFunc(cfg.Sources, func(c *jetstream.StreamSource) bool { return sameSource(c, src) }) {
		return nil // another reconciler added it back
	}
	cfg.Sources = append(slices.Clone(cfg.Sources), src)
	if _, err := r.js.UpdateStream(ctx, cfg); err != nil {
		return fmt.Errorf("update stream %s with source %s: %w", in, src.Name, err)
	}
	return nil
}

func sameSource(a, b *jetstream.StreamSource) bool {
	return a.Name == b.Name && a.FilterSubject == b.FilterSubject
}
