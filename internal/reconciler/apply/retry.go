package apply

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/limiterd/limiterd/internal/redisstore"
	"github.com/limiterd/limiterd/pkg/gossip"
	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

// The retry stream.
//
// A client's debit that cannot be applied now (its Redis node down) is not
// waited for by the other clients of its message: it is published to this
// region's retry stream, and the message is acknowledged. Its subject names
// the source region and the bucket of the client's hash slot (slot / 64,
// 256 buckets; a node holds whole ranges of slots), and while a bucket has
// entries there, the apply loop sends every later debit of a client of that
// bucket there too, behind them. The retry loop reads a source's entries in
// order, one at a time, and applies each with the position of the message
// it came from and the same markers as the apply loop, so for every client
// the debits are applied in stream order, each at most once: an entry whose
// debit had been applied before its failure was seen (a reply lost) is a
// duplicate to the marker, and an entry published twice is applied once.
// An entry that fails again stays at the head until its node is back: what
// waits behind it is the debits of the buckets that failed, not the others.

// retryBuckets is the number of buckets of hash slots.
const retryBuckets = 256

// bucketOf is the bucket of the hash slot of key's buckets and markers:
// the slot of their hash tag, the whole key (redisstore.Key).
func bucketOf(key string) int {
	return redisstore.Slot(redisstore.Key("", key)) * retryBuckets / 16384
}

// retryEntry is one message's debits of the clients of one bucket, to apply
// again.
type retryEntry struct {
	Source string `json:"source"`
	// Epoch and Seq are the position of the message in the inbound stream.
	Epoch         int64  `json:"epoch"`
	Seq           uint64 `json:"seq"`
	FirstAdmitted int64  `json:"first_admitted_unix_micros"`
	// Flushed is the message's flush instant, which its debits' last
	// admissions count back from (0 in an entry of an older reconciler:
	// each debit is then applied as of now).
	Flushed int64 `json:"flushed_unix_micros,omitempty"`
	// Partition is the partition the message came on: its markers and
	// record are the partition's. It must be set.
	Partition *int `json:"partition"`
	// Flush, when set, is the name of the message's flush, whose record
	// could not be written: the retry writes it before applying.
	Flush   *flushName    `json:"flush,omitempty"`
	Clients []retryClient `json:"clients"`
}

type flushName struct {
	Instance string `json:"instance"`
	Sequence uint64 `json:"sequence"`
	Part     uint32 `json:"part"`
}

type retryClient struct {
	Key    string       `json:"key"`
	Debits []retryDebit `json:"debits"`
}

type retryDebit struct {
	Rule   string  `json:"rule"`
	Amount float64 `json:"amount"`
	// Reset: the key was reset before Amount (gossipv1.Spend.reset_before).
	Reset bool `json:"reset,omitempty"`
	// BeforeFlush is gossipv1.Spend.last_admitted_ms_before_flush.
	BeforeFlush uint32 `json:"last_admitted_ms_before_flush,omitempty"`
}

// spend is d of key as a spend message's entry.
func (d retryDebit) spend(key string) *gossipv1.Spend {
	return &gossipv1.Spend{RuleId: d.Rule, Key: key, Cost: d.Amount, ResetBefore: d.Reset, LastAdmittedMsBeforeFlush: d.BeforeFlush}
}

// errInvalidRetry wraps every reason a retry entry is refused.
var errInvalidRetry = errors.New("invalid retry entry")

// decodeRetry parses and validates an entry of src's retries; errors name
// the field.
func decodeRetry(data []byte, src string) (*retryEntry, error) {
	var e retryEntry
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&e); err != nil {
		return nil, fmt.Errorf("%w: %w", errInvalidRetry, err)
	}
	switch {
	case e.Source != src:
		return nil, fmt.Errorf("%w: source: %q on %s's subject", errInvalidRetry, e.Source, src)
	case e.Epoch <= 0 || e.Seq == 0:
		return nil, fmt.Errorf("%w: epoch, seq: must be set", errInvalidRetry)
	case e.FirstAdmitted <= 0:
		return nil, fmt.Errorf("%w: first_admitted_unix_micros: must be set", errInvalidRetry)
	case e.Flushed < 0:
		return nil, fmt.Errorf("%w: flushed_unix_micros: must not be below 0", errInvalidRetry)
	case len(e.Clients) == 0 || len(e.Clients) > gossip.MaxSpendsPerBatch:
		return nil, fmt.Errorf("%w: clients: %d, want 1 to %d", errInvalidRetry, len(e.Clients), gossip.MaxSpendsPerBatch)
	case e.Partition == nil:
		return nil, fmt.Errorf("%w: partition: must be set", errInvalidRetry)
	case *e.Partition < 0 || *e.Partition >= gossip.MaxPartitions:
		return nil, fmt.Errorf("%w: partition: must be 0 to %d, got %d", errInvalidRetry, gossip.MaxPartitions-1, *e.Partition)
	case e.Flush != nil && (e.Flush.Instance == "" || len(e.Flush.Instance) > 128):
		return nil, fmt.Errorf("%w: flush.instance: must be 1 to 128 bytes", errInvalidRetry)
	}
	for i, c := range e.Clients {
		if len(c.Debits) == 0 {
			return nil, fmt.Errorf("%w: clients[%d].debits: none", errInvalidRetry, i)
		}
		for j, d := range c.Debits {
			if err := gossip.ValidateSpend(j, d.spend(c.Key)); err != nil {
				return nil, fmt.Errorf("%w: clients[%d]: %w", errInvalidRetry, i, err)
			}
		}
	}
	return &e, nil
}

// retrySubject is the subject of src's retries of bucket.
func (a *Applier) retrySubject(src string, bucket int) string {
	return gossip.RetrySubjectPrefix + a.opts.Region + "." + src + "." + strconv.Itoa(bucket)
}

// publishRetries publishes clients' debits, one entry per bucket, in
// order, each with an id made of its message's position and its bucket (so
// one published twice within the duplicate window is stored once).
func (a *Applier) publishRetries(ctx context.Context, entry retryEntry, clients []redisstore.ClientDebits) error {
	byBucket := map[int][]retryClient{}
	var order []int
	for _, c := range clients {
		b := bucketOf(c.Key)
		if _, ok := byBucket[b]; !ok {
			order = append(order, b)
		}
		rc := retryClient{Key: c.Key}
		for _, d := range c.Debits {
			rd := retryDebit{Rule: d.Rule, Amount: d.Amount, Reset: d.Reset}
			if entry.Flushed > 0 && d.At > 0 {
				// d.At is the last admission with the allowance added.
				rd.BeforeFlush = uint32(max(entry.Flushed-(d.At-a.opts.ClockAllowance.Microseconds()), 0) / 1000)
			}
			rc.Debits = append(rc.Debits, rd)
		}
		byBucket[b] = append(byBucket[b], rc)
	}
	for _, b := range order {
		e := entry
		e.Clients = byBucket[b]
		data, err := json.Marshal(e)
		if err != nil {
			return err
		}
		id := fmt.Sprintf("%s-%d-%d-%d", e.Source, e.Epoch, e.Seq, b)
		pctx, cancel := context.WithTimeout(ctx, a.opts.AckWait/2)
		_, err = a.js.Publish(pctx, a.retrySubject(entry.Source, b), data, jetstream.WithMsgID(id))
		cancel()
		if err != nil {
			return fmt.Errorf("publish retry of bucket %d: %w", b, err)
		}
	}
	return nil
}

// Requester sends a request and waits for its reply, as a *nats.Conn.
type Requester interface {
	RequestWithContext(ctx context.Context, subj string, data []byte) (*nats.Msg, error)
}

// StreamPending is a RetryStream of the stream Name: a JetStream stream
// info request with a subject filter, as jetstream.Stream's Info with
// WithSubjectFilter makes, of which only the counts are decoded. Read
// once per message of every partition, the whole info (the stream's
// configuration, cluster and state) took more CPU to decode than the rest
// of the request.
type StreamPending struct {
	NC   Requester
	Name string
}

// Pending asks the server for the counts of the subjects matching filter,
// a page at a time.
func (s StreamPending) Pending(ctx context.Context, filter string) (map[string]uint64, error) {
	var out map[string]uint64
	for {
		req, err := json.Marshal(struct {
			Filter string `json:"subjects_filter"`
			Offset int    `json:"offset,omitempty"`
		}{filter, len(out)})
		if err != nil {
			return nil, err
		}
		msg, err := s.NC.RequestWithContext(ctx, "$JS.API.STREAM.INFO."+s.Name, req)
		if err != nil {
			return nil, fmt.Errorf("stream %s: %w", s.Name, err)
		}
		var resp struct {
			Error *jetstream.APIError `json:"error"`
			Total int                 `json:"total"`
			State struct {
				Subjects map[string]uint64 `json:"subjects"`
			} `json:"state"`
		}
		if err := json.Unmarshal(msg.Data, &resp); err != nil {
			return nil, fmt.Errorf("stream %s: %w", s.Name, err)
		}
		if resp.Error != nil {
			if resp.Error.ErrorCode == jetstream.JSErrCodeStreamNotFound {
				return nil, fmt.Errorf("stream %s: %w", s.Name, jetstream.ErrStreamNotFound)
			}
			return nil, fmt.Errorf("stream %s: %w", s.Name, resp.Error)
		}
		if len(resp.State.Subjects) == 0 {
			return out, nil
		}
		if out == nil {
			out = make(map[string]uint64, len(resp.State.Subjects))
		}
		maps.Copy(out, resp.State.Subjects)
		if len(out) >= resp.Total {
			return out, nil
		}
	}
}

// pendingBuckets are the buckets of src with entries in the retry stream.
func (a *Applier) pendingBuckets(ctx context.Context, src Source) (map[int]bool, error) {
	ictx, cancel := context.WithTimeout(ctx, a.opts.AckWait/2)
	defer cancel()
	subjects, err := src.Retry.Pending(ictx, gossip.RetrySubjects(a.opts.Region, src.Name))
	if err != nil {
		return nil, err
	}
	if len(subjects) == 0 {
		return nil, nil
	}
	prefix := gossip.RetrySubjectPrefix + a.opts.Region + "." + src.Name + "."
	out := map[int]bool{}
	for subject, n := range subjects {
		if b, err := strconv.Atoi(strings.TrimPrefix(subject, prefix)); err == nil && n > 0 {
			out[b] = true
		}
	}
	return out, nil
}

// Retry applies one entry of src's retry stream, with the position of the
// message it came from and the same markers as Apply, then acknowledges
// it, asks for it again later, or rejects it.
func (a *Applier) Retry(ctx context.Context, src Source, msg jetstream.Msg) {
	e, err := decodeRetry(msg.Data(), src.Name)
	if err != nil {
		a.Reject(msg, "retry "+src.Name, err)
		return
	}
	pos := redisstore.Position{Epoch: e.Epoch, Seq: e.Seq, Partition: *e.Partition}
	actx, cancel := context.WithTimeout(context.Background(), DefaultTimeout)
	defer cancel()
	if f := e.Flush; f != nil {
		first, err := a.store.FirstSeen(actx, recordSource(src.Name, pos.Partition), f.Instance, f.Sequence, f.Part, pos, a.recordTTL())
		if err != nil {
			a.log.Warn("retry: message not recorded, will retry", "source", src.Name, "seq", e.Seq, "err", err)
			msg.NakWithDelay(time.Second)
			return
		}
		if first != pos.String() {
			a.m.Replays.WithLabelValues(src.Name).Inc()
			a.ack(ctx, src.Name, e.Seq, msg)
			return
		}
	}
	spends := make([]*gossipv1.Spend, 0, len(e.Clients))
	for _, c := range e.Clients {
		for _, d := range c.Debits {
			spends = append(spends, d.spend(c.Key))
		}
	}
	clients, _ := a.debits(spends, e.Flushed)
	res, err := a.store.ApplyDebits(actx, src.Name, pos, a.MarkerTTL(), clients)
	a.observe(src.Name, e.FirstAdmitted, res, clients)
	if err != nil {
		a.log.Warn("retry: debits not applied, will retry", "source", src.Name, "seq", e.Seq, "failed", len(res.Failed), "err", err)
		msg.NakWithDelay(time.Second)
		return
	}
	a.m.Retried.WithLabelValues(src.Name).Add(float64(res.Applied))
	a.ack(ctx, src.Name, e.Seq, msg)
}
