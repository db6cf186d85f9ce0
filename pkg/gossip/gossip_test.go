package gossip

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"

	"google.golang.org/protobuf/proto"

	gossipv1 "github.com/limiterd/limiterd/proto/gossip/v1"
)

func TestAccumulator(t *testing.T) {
	var a Accumulator
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			for j := range 1000 {
				a.Add("r", fmt.Sprint("k", j%10), 0.5, 0, int64(100+i))
			}
		})
	}
	wg.Wait()
	spends, first := a.Drain()
	if len(spends) != 10 || first != 100 {
		t.Fatalf("Drain: %d spends, first %d; want 10, 100", len(spends), first)
	}
	for _, s := range spends {
		if s.Cost != 400 {
			t.Fatalf("%+v: want cost 8*100*0.5 = 400", s)
		}
	}
	if again, _ := a.Drain(); len(again) != 0 || a.Len() != 0 {
		t.Fatalf("second Drain returned %d spends", len(again))
	}
}

func header() Header {
	return Header{Region: "us-east", Instance: "lim-1", Sequence: 7, FirstAdmitted: 1, Flushed: 2}
}

func TestSplitRoundTrip(t *testing.T) {
	var spends []Spend
	for i := range 5000 {
		spends = append(spends, Spend{Rule: "api", Key: fmt.Sprintf("user:%06d", i), Cost: float64(i%7) + 0.5})
	}
	const maxBytes = 16 << 10
	parts, err := Split(header(), spends, maxBytes)
	if err != nil {
		t.Fatal(err)
	}
	if len(parts) < 5 {
		t.Fatalf("5000 spends in %d parts of at most %d bytes", len(parts), maxBytes)
	}
	var got []Spend
	for i, p := range parts {
		if len(p) > maxBytes {
			t.Fatalf("part %d is %d bytes, above %d", i, len(p), maxBytes)
		}
		b, err := Decode(p, maxBytes)
		if err != nil {
			t.Fatalf("part %d: %v", i, err)
		}
		if b.GetPart() != uint32(i) || b.GetParts() != uint32(len(parts)) || b.GetSequence() != 7 || b.GetRegion() != "us-east" {
			t.Fatalf("part %d header: %v", i, b)
		}
		for _, s := range b.GetSpends() {
			got = append(got, Spend{Rule: s.GetRuleId(), Key: s.GetKey(), Cost: s.GetCost()})
		}
	}
	if len(got) != len(spends) {
		t.Fatalf("%d spends back, sent %d", len(got), len(spends))
	}
	for i := range got {
		if got[i] != spends[i] {
			t.Fatalf("spend %d: %+v, sent %+v", i, got[i], spends[i])
		}
	}
	if parts, err := Split(header(), nil, maxBytes); err != nil || parts != nil {
		t.Fatalf("empty flush: %v, %v", parts, err)
	}
	if _, err := Split(header(), []Spend{{Rule: "a", Key: strings.Repeat("k", 512), Cost: 1}}, 256); err == nil {
		t.Fatal("a spend larger than a message was accepted")
	}
}

func TestDecodeRejects(t *testing.T) {
	valid := func() *gossipv1.SpendBatch {
		return &gossipv1.SpendBatch{Region: "eu-west", Instance: "i", Sequence: 1, Part: 0, Parts: 1,
			FirstAdmittedUnixMicros: 1, FlushedUnixMicros: 1,
			Spends: []*gossipv1.Spend{{RuleId: "api", Key: "k", Cost: 1}}}
	}
	tests := []struct {
		name   string
		mutate func(*gossipv1.SpendBatch)
		field  string
	}{
		{"valid", func(*gossipv1.SpendBatch) {}, ""},
		{"bad region", func(b *gossipv1.SpendBatch) { b.Region = "EU West" }, "region"},
		{"no instance", func(b *gossipv1.SpendBatch) { b.Instance = "" }, "instance"},
		{"part out of range", func(b *gossipv1.SpendBatch) { b.Part = 1 }, "part"},
		{"no time", func(b *gossipv1.SpendBatch) { b.FirstAdmittedUnixMicros = 0 }, "first_admitted"},
		{"no spends", func(b *gossipv1.SpendBatch) { b.Spends = nil }, "spends"},
		{"bad rule", func(b *gossipv1.SpendBatch) { b.Spends[0].RuleId = "~x" }, "spends[0].rule_id"},
		{"empty key", func(b *gossipv1.SpendBatch) { b.Spends[0].Key = "" }, "spends[0].key"},
		{"long key", func(b *gossipv1.SpendBatch) { b.Spends[0].Key = strings.Repeat("k", 513) }, "spends[0].key"},
		{"NaN cost", func(b *gossipv1.SpendBatch) { b.Spends[0].Cost = math.NaN() }, "spends[0].cost"},
		{"zero cost", func(b *gossipv1.SpendBatch) { b.Spends[0].Cost = 0 }, "spends[0].cost"},
		{"a give-back", func(b *gossipv1.SpendBatch) { b.Spends[0].Cost = -1 }, ""},
		{"huge give-back", func(b *gossipv1.SpendBatch) { b.Spends[0].Cost = -1e300 }, "spends[0].cost"},
		{"negative infinite cost", func(b *gossipv1.SpendBatch) { b.Spends[0].Cost = math.Inf(-1) }, "spends[0].cost"},
		{"infinite cost", func(b *gossipv1.SpendBatch) { b.Spends[0].Cost = math.Inf(1) }, "spends[0].cost"},
		{"huge cost", func(b *gossipv1.SpendBatch) { b.Spends[0].Cost = 1e300 }, "spends[0].cost"},
		{"admitted an hour before the flush", func(b *gossipv1.SpendBatch) { b.Spends[0].LastAdmittedMsBeforeFlush = 3_600_000 }, ""},
		{"admitted longer before the flush", func(b *gossipv1.SpendBatch) { b.Spends[0].LastAdmittedMsBeforeFlush = 3_600_001 }, "spends[0].last_admitted_ms_before_flush"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := valid()
			tt.mutate(b)
			data, err := proto.Marshal(b)
			if err != nil {
				t.Fatal(err)
			}
			_, err = Decode(data, DefaultMaxMessageBytes)
			if tt.field == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, ErrInvalidBatch) || !strings.Contains(err.Error(), tt.field) {
				t.Fatalf("Decode = %v, want ErrInvalidBatch naming %s", err, tt.field)
			}
		})
	}
	if _, err := Decode([]byte{0xff, 0xff, 0xff}, 100); !errors.Is(err, ErrInvalidBatch) {
		t.Fatalf("garbage: %v", err)
	}
	if _, err := Decode(make([]byte, 101), 100); !errors.Is(err, ErrInvalidBatch) {
		t.Fatalf("oversized: %v", err)
	}
}

// TestDecodeEntriesSkipsBadEntries: an invalid entry (an oversized cost, a
// bad rule id, an empty key) is taken out and reported naming its index and
// field; the good entries around it stay, in order. A header fault still
// refuses the batch.
func TestDecodeEntriesSkipsBadEntries(t *testing.T) {
	b := &gossipv1.SpendBatch{Region: "eu-west", Instance: "i", Sequence: 1, Parts: 1,
		FirstAdmittedUnixMicros: 1, FlushedUnixMicros: 1, Spends: []*gossipv1.Spend{
			{RuleId: "api", Key: "a", Cost: 1},
			{RuleId: "api", Key: "huge", Cost: 2 * MaxCost},
			{RuleId: "api", Key: "b", Cost: 2},
			{RuleId: "~x", Key: "c", Cost: 1},
			{RuleId: "api", Key: "", Cost: 1},
			{RuleId: "api", Key: "d", Cost: MaxCost},
		}}
	data, err := proto.Marshal(b)
	if err != nil {
		t.Fatal(err)
	}
	got, bad, err := DecodeEntries(data, DefaultMaxMessageBytes)
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, s := range got.GetSpends() {
		keys = append(keys, s.GetKey())
	}
	if strings.Join(keys, ",") != "a,b,d" {
		t.Errorf("kept %v, want a, b, d", keys)
	}
	want := []string{"spends[1].cost", "spends[3].rule_id", "spends[4].key"}
	if len(bad) != len(want) {
		t.Fatalf("bad entries %v, want %v", bad, want)
	}
	for i, field := range want {
		if !errors.Is(bad[i], ErrInvalidBatch) || !strings.Contains(bad[i].Error(), field) {
			t.Errorf("bad[%d] = %v, want ErrInvalidBatch naming %s", i, bad[i], field)
		}
	}
	// Decode stays strict: the same bytes are refused whole.
	if _, err := Decode(data, DefaultMaxMessageBytes); !errors.Is(err, ErrInvalidBatch) {
		t.Errorf("Decode = %v, want ErrInvalidBatch", err)
	}
	b.Region = "EU West"
	data, _ = proto.Marshal(b)
	if _, _, err := DecodeEntries(data, DefaultMaxMessageBytes); !errors.Is(err, ErrInvalidBatch) || !strings.Contains(err.Error(), "region") {
		t.Errorf("bad header: %v, want ErrInvalidBatch naming region", err)
	}
}

func TestNames(t *testing.T) {
	for got, want := range map[string]string{
		RegionStream("eu-west"): "LIMITER_SPENDS_EU_WEST", InStream("ap-south"): "LIMITER_IN_AP_SOUTH",
		RetryStream("us-east"): "LIMITER_RETRY_US_EAST", PartitionSubject("us-east", 3): "limiter.relay.us-east.3",
		PartitionSubjects("us-east"):        "limiter.relay.us-east.*",
		RetrySubjects("eu-west", "us-east"): "limiter.retry.eu-west.us-east.>",
	} {
		if got != want {
			t.Errorf("got %q, want %q", got, want)
		}
	}
	if got := LocalStream("eu-west-2"); got != "LIMITER_LOCAL_EU_WEST_2" {
		t.Fatalf("LocalStream = %q", got)
	}
	if PartitionSubject("us-east", 0) != "limiter.relay.us-east.0" || LocalSubject("us-east") != "limiter.local.us-east" {
		t.Fatal("subjects changed")
	}
}

// FuzzDecode: any bytes decode to a batch that passes Validate, or fail
// with ErrInvalidBatch; never a panic.
func FuzzDecode(f *testing.F) {
	parts, _ := Split(header(), []Spend{{Rule: "api", Key: "k", Cost: 1}, {Rule: "b", Key: "j", Cost: 2.5}}, 1<<10)
	for _, p := range parts {
		f.Add(p)
	}
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := Decode(data, 1<<16)
		if err != nil {
			if !errors.Is(err, ErrInvalidBatch) {
				t.Fatalf("error %v does not wrap ErrInvalidBatch", err)
			}
			return
		}
		if err := Validate(b); err != nil {
			t.Fatalf("decoded batch fails Validate: %v", err)
		}
	})
}

// BenchmarkAccumulatorAdd is what recording an admitted spend costs a
// check: one key spent again and again, and 10,000 keys in turn (the long
// tail, drained every 100,000 adds as an interval would).
func BenchmarkAccumulatorAdd(b *testing.B) {
	b.Run("one-key", func(b *testing.B) {
		b.ReportAllocs()
		var a Accumulator
		for b.Loop() {
			a.Add("r", "k", 1, 10, 100)
		}
	})
	b.Run("many-keys", func(b *testing.B) {
		b.ReportAllocs()
		keys := make([]string, 10_000)
		for i := range keys {
			keys[i] = fmt.Sprint("key-", i)
		}
		var a Accumulator
		i := 0
		for b.Loop() {
			a.Add("r", keys[i%len(keys)], 1, 10, 100)
			if i++; i%100_000 == 0 {
				a.Drain()
			}
		}
	})
}

// A key is hot once its sum reaches its budget: Hot signals the first,
// DrainHot takes the hot keys alone, and the key starts afresh.
func TestAccumulatorHot(t *testing.T) {
	var a Accumulator
	hot := a.Hot()
	a.Add("r", "quiet", 4, 5, 10)
	a.Add("r", "loud", 4, 5, 20)
	select {
	case <-hot:
		t.Fatal("Hot signalled with no key at its budget")
	default:
	}
	a.Add("r", "loud", 1, 5, 15)
	a.Add("r", "other", 7, 5, 30)
	select {
	case <-hot:
	default:
		t.Fatal("Hot did not signal a key reaching its budget")
	}
	if got, first := a.DrainHot(); len(got) != 2 || got[0] != (Spend{Rule: "r", Key: "loud", Cost: 5, Last: 20}) || got[1] != (Spend{Rule: "r", Key: "other", Cost: 7, Last: 30}) || first != 15 {
		t.Fatalf("DrainHot = %v, first %d; want loud 5 and other 7, first 15", got, first)
	}
	if got, _ := a.DrainHot(); len(got) != 0 {
		t.Fatalf("DrainHot again = %v, want nothing", got)
	}
	a.Add("r", "loud", 1, 5, 40)
	if a.Len() != 2 {
		t.Fatalf("Len = %d, want 2: quiet, and loud again", a.Len())
	}
	got, first := a.Drain()
	slices.SortFunc(got, func(x, y Spend) int { return strings.Compare(x.Key, y.Key) })
	if len(got) != 2 || got[0] != (Spend{Rule: "r", Key: "loud", Cost: 1, Last: 40}) || got[1] != (Spend{Rule: "r", Key: "quiet", Cost: 4, Last: 10}) || first != 10 {
		t.Fatalf("Drain = %v, first %d; want loud 1 and quiet 4, first 10", got, first)
	}
	// A budget of 0 never makes a key hot.
	a.Add("r", "k", 1e9, 0, 1)
	if got, _ := a.DrainHot(); len(got) != 0 {
		t.Fatalf("DrainHot with no budget = %v", got)
	}
}

// TestAccumulatorDrainDue: a key under its budget waits up to drains
// drains, then goes out; one at its budget, or without one, goes out at
// once; a held key that reaches its budget is hot; its first admission is
// the drain it was held at.
func TestAccumulatorDrainDue(t *testing.T) {
	var a Accumulator
	hot := a.Hot()
	a.Add("r", "quiet", 1, 5, 10)
	a.Add("r", "nobudget", 1, 0, 11)
	a.Add("r", "full", 5, 5, 12)
	<-hot // full reached its budget
	got, first := a.DrainDue(3, 100)
	slices.SortFunc(got, func(x, y Spend) int { return strings.Compare(x.Key, y.Key) })
	if len(got) != 2 || got[0] != (Spend{Rule: "r", Key: "full", Cost: 5, Last: 12}) || got[1] != (Spend{Rule: "r", Key: "nobudget", Cost: 1, Last: 11}) || first != 11 {
		t.Fatalf("first DrainDue = %v, first %d; want full 5 and nobudget 1, first 11", got, first)
	}
	if a.Len() != 1 {
		t.Fatalf("Len = %d after the first DrainDue, want 1 (quiet held)", a.Len())
	}
	a.Add("r", "quiet", 1, 5, 150)
	if got, _ := a.DrainDue(3, 200); len(got) != 0 {
		t.Fatalf("second DrainDue = %v, want nothing: quiet (2 of 5) may wait 3 drains", got)
	}
	if got, first := a.DrainDue(3, 300); len(got) != 1 || got[0] != (Spend{Rule: "r", Key: "quiet", Cost: 2, Last: 150}) || first != 200 {
		t.Fatalf("third DrainDue = %v, first %d; want quiet 2 at its bound, last admitted at 150, first 200 (the drain it was last held at)", got, first)
	}

	// A held key reaching its budget is hot, and DrainHot takes it.
	a.Add("r", "k", 3, 5, 400)
	a.DrainDue(10, 500)
	a.Add("r", "k", 2, 5, 600)
	select {
	case <-hot:
	default:
		t.Fatal("Hot did not signal a held key reaching its budget")
	}
	if got, _ := a.DrainHot(); len(got) != 1 || got[0] != (Spend{Rule: "r", Key: "k", Cost: 5, Last: 600}) {
		t.Fatalf("DrainHot = %v, want k 5", got)
	}
	if got, _ := a.DrainDue(10, 700); len(got) != 0 || a.Len() != 0 {
		t.Fatalf("DrainDue after DrainHot = %v, Len %d; want nothing", got, a.Len())
	}
}

// TestAccumulatorFull: at MaxKeys waiting keys the accumulator is full
// and says so on Hot; a key past the bound is still recorded; Drain
// empties it.
func TestAccumulatorFull(t *testing.T) {
	a := Accumulator{MaxKeys: 3}
	hot := a.Hot()
	a.Add("r", "a", 1, 5, 1)
	a.Add("r", "b", 1, 5, 1)
	if a.Full() {
		t.Fatal("full at 2 of 3 keys")
	}
	a.Add("r", "c", 1, 5, 1)
	a.Add("r", "d", 1, 5, 1)
	if !a.Full() {
		t.Fatal("not full at 4 keys of 3")
	}
	select {
	case <-hot:
	default:
		t.Fatal("Hot did not signal the accumulator full")
	}
	if got, _ := a.DrainDue(10, 2); len(got) != 0 || !a.Full() {
		t.Fatalf("DrainDue of 4 quiet keys = %v, full %v; want none out and still full", got, a.Full())
	}
	if got, _ := a.Drain(); len(got) != 4 || a.Full() {
		t.Fatalf("Drain = %d keys, full %v; want all 4, not full", len(got), a.Full())
	}
}

// TestAccumulatorReset: a reset drops the key's waiting sum, makes the key
// hot, and its entry carries the reset then what was admitted after it,
// held by no DrainDue; a key reset with nothing after it still goes out.
func TestAccumulatorReset(t *testing.T) {
	tests := []struct {
		name  string
		drain func(a *Accumulator) []Spend
	}{
		{"Drain", func(a *Accumulator) []Spend { s, _ := a.Drain(); return s }},
		{"DrainDue", func(a *Accumulator) []Spend { s, _ := a.DrainDue(10, 50); return s }},
		{"DrainHot", func(a *Accumulator) []Spend { s, _ := a.DrainHot(); return s }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var a Accumulator
			hot := a.Hot()
			a.Add("r", "k", 3, 100, 10)
			a.Add("r", "other", 2, 100, 10)
			a.Reset("r", "k", 20)
			a.Add("r", "k", 1.5, 100, 30)
			a.Reset("r", "quiet", 25)
			select {
			case <-hot:
			default:
				t.Fatal("a reset did not signal Hot")
			}
			got := tc.drain(&a)
			slices.SortFunc(got, func(x, y Spend) int { return strings.Compare(x.Key, y.Key) })
			want := []Spend{{Rule: "r", Key: "k", Cost: 1.5, Reset: true, Last: 30}, {Rule: "r", Key: "quiet", Reset: true, Last: 25}}
			if tc.name == "Drain" {
				want = []Spend{want[0], {Rule: "r", Key: "other", Cost: 2, Last: 10}, want[1]}
			}
			if !slices.Equal(got, want) {
				t.Fatalf("drained %+v, want %+v", got, want)
			}
			a.Add("r", "k", 1, 100, 40)
			rest, _ := a.Drain()
			for _, s := range rest {
				if s.Reset {
					t.Fatalf("%+v: a key's reset went out twice", s)
				}
			}
		})
	}
}

// TestResetRoundTrip: a reset entry, with or without a cost, crosses the
// wire and is valid; a zero cost without the reset is not.
func TestResetRoundTrip(t *testing.T) {
	sent := []Spend{{Rule: "api", Key: "a", Reset: true}, {Rule: "api", Key: "b", Cost: 2, Reset: true}, {Rule: "api", Key: "c", Cost: 1}}
	parts, err := Split(header(), sent, DefaultMaxMessageBytes)
	if err != nil {
		t.Fatal(err)
	}
	b, err := Decode(parts[0], DefaultMaxMessageBytes)
	if err != nil {
		t.Fatal(err)
	}
	var got []Spend
	for _, s := range b.GetSpends() {
		got = append(got, Spend{Rule: s.GetRuleId(), Key: s.GetKey(), Cost: s.GetCost(), Reset: s.GetResetBefore()})
	}
	if !slices.Equal(got, sent) {
		t.Fatalf("got %+v, sent %+v", got, sent)
	}
	err = ValidateSpend(0, &gossipv1.Spend{RuleId: "api", Key: "a"})
	if !errors.Is(err, ErrInvalidBatch) {
		t.Fatalf("a zero cost without a reset: %v, want ErrInvalidBatch", err)
	}
}

// TestLastAdmittedRoundTrip: an entry carries its last admission as whole
// ms before the flush, rounded toward the flush (never read earlier than
// it was), at most MaxAdmittedBeforeFlush; unknown, or not before the
// flush, is the flush.
func TestLastAdmittedRoundTrip(t *testing.T) {
	h := header()
	h.Flushed = 1_796_000_000_000_000
	f := h.Flushed
	tests := []struct {
		last, want int64
	}{
		{f - 1_500_000, f - 1_500_000},
		{f - 1_500_999, f - 1_500_000},
		{f - 999, f},
		{0, f},
		{f + 5_000, f},
		{f - 2*MaxAdmittedBeforeFlush.Microseconds(), f - MaxAdmittedBeforeFlush.Microseconds()},
	}
	var sent []Spend
	for i, tt := range tests {
		sent = append(sent, Spend{Rule: "api", Key: fmt.Sprint("k", i), Cost: 1, Last: tt.last})
	}
	parts, err := Split(h, sent, DefaultMaxMessageBytes)
	if err != nil {
		t.Fatal(err)
	}
	b, err := Decode(parts[0], DefaultMaxMessageBytes)
	if err != nil {
		t.Fatal(err)
	}
	for i, s := range b.GetSpends() {
		if got := LastAdmitted(s, b.GetFlushedUnixMicros()); got != tests[i].want {
			t.Errorf("last admitted %d µs before the flush: read %d before, want %d", f-tests[i].last, f-got, f-tests[i].want)
		}
	}
}
