package scale

import (
	"errors"
	"flag"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/limiterd/limiterd/internal/spendpub"
	"github.com/limiterd/limiterd/pkg/gossip"
)

// The knobs of a run. Their defaults are the smoke run that `go test`
// makes; `make scale` gives larger ones.
var (
	flagRegions    = flag.Int("scale.regions", 3, "regions, 2 to 16")
	flagKeys       = flag.Int("scale.keys", 3000, "clients in the population every region draws from (Zipf), 1 to 10,000,000")
	flagRate       = flag.Int("scale.rate", 100, "admitted checks per second in each region, 1 to 200,000")
	flagZipf       = flag.Float64("scale.zipf", 1.1, "Zipf exponent of the clients' traffic, above 1 and at most 3; 0: every client alike (uniform)")
	flagPublishers = flag.Int("scale.publishers", 2, "limiterd instances (synthetic publishers) per region, each check to one at random, 1 to 64")
	flagDuration   = flag.Duration("scale.duration", 3*time.Second, "traffic measured, up to 10m")
	flagWarmup     = flag.Duration("scale.warmup", 2*time.Second, "traffic before the measurement, up to 10m (max-defer + an interval reaches the steady state)")
	flagInterval   = flag.Duration("scale.interval", gossip.DefaultInterval, "--gossip.interval of the publishers and reconcilers")
	flagMaxDefer   = flag.Duration("scale.max-defer", spendpub.DefaultMaxDefer, "--gossip.max-defer of the publishers (0: off)")
	flagWAN        = flag.String("scale.wan", "0", "one-way delay between every two regions: 0, a duration up to 1s, or spread (50 ms between neighbours in the list to 150 ms between its ends)")
	flagPrimaries  = flag.Int("scale.primaries", 1, "Redis primaries per region, 1 to 6")
	flagAffinity   = flag.Bool("scale.affinity", false, "each client's checks go to one publisher (a hash of the key), which holds the client's whole budget, as limiterd with --gossip.key-affinity; false: to one at random, each holding budget / publishers")
	flagHome       = flag.Bool("scale.home", false, "each client checks in one region only, the design's shape: every region draws from its own population of -scale.keys clients; false: every region draws from one population")
	flagPaced      = flag.Bool("scale.paced", true, "the publishers pace each entry by the rule's refill rate, as limiterd does (gossip.Accumulator.AddPaced); false: each entry as of its last admission")
	flagCheckCalls = flag.Int("scale.check-calls", 20_000, "check scripts run on the first region's Redis to measure what a check costs it, 1,000 to 1,000,000")
)

// config is one run's knobs, validated.
type config struct {
	regions, keys, rate, publishers, primaries, checkCalls int
	zipf                                                   float64
	affinity, home, paced                                  bool
	duration, warmup, interval, maxDefer                   time.Duration
	wan                                                    string
}

func configFromFlags() config {
	return config{
		regions: *flagRegions, keys: *flagKeys, rate: *flagRate, publishers: *flagPublishers,
		primaries: *flagPrimaries, checkCalls: *flagCheckCalls, zipf: *flagZipf,
		duration: *flagDuration, warmup: *flagWarmup, interval: *flagInterval, maxDefer: *flagMaxDefer,
		wan: *flagWAN, affinity: *flagAffinity, home: *flagHome, paced: *flagPaced,
	}
}

// validate reports every bad knob at once, each error naming its flag.
func (c config) validate() error {
	var errs []error
	ints := []struct {
		flag    string
		v, l, h int
	}{
		{"-scale.regions", c.regions, 2, 16},
		{"-scale.keys", c.keys, 1, 10_000_000},
		{"-scale.rate", c.rate, 1, 200_000},
		{"-scale.publishers", c.publishers, 1, 64},
		{"-scale.primaries", c.primaries, 1, 6},
		{"-scale.check-calls", c.checkCalls, 1000, 1_000_000},
	}
	for _, f := range ints {
		if f.v < f.l || f.v > f.h {
			errs = append(errs, fmt.Errorf("%s: must be %d to %d, got %d", f.flag, f.l, f.h, f.v))
		}
	}
	if c.zipf != 0 && !(c.zipf > 1 && c.zipf <= 3) {
		errs = append(errs, fmt.Errorf("-scale.zipf: must be 0 or above 1 and at most 3, got %v", c.zipf))
	}
	if c.duration <= 0 || c.duration > 10*time.Minute {
		errs = append(errs, fmt.Errorf("-scale.duration: must be in (0, 10m], got %v", c.duration))
	}
	if c.warmup < 0 || c.warmup > 10*time.Minute {
		errs = append(errs, fmt.Errorf("-scale.warmup: must be in [0, 10m], got %v", c.warmup))
	}
	if c.interval < gossip.MinInterval || c.interval > time.Minute {
		errs = append(errs, fmt.Errorf("-scale.interval: must be in [%v, 1m], got %v", gossip.MinInterval, c.interval))
	}
	if c.maxDefer != 0 && (c.maxDefer < c.interval || c.maxDefer > time.Minute) {
		errs = append(errs, fmt.Errorf("-scale.max-defer: must be 0 or in [-scale.interval, 1m], got %v", c.maxDefer))
	}
	if _, err := wanDelays(c.wan, regionNames(2)); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// client is the key of the client of rank (in the population's draw)
// that checks in region i: c<rank>, one population shared by every
// region, or with -scale.home c<i>-<rank>, each region's clients its own,
// as the design's clients each check in one region.
func (c config) client(i, rank uint64) string {
	if c.home {
		return "c" + strconv.FormatUint(i, 10) + "-" + strconv.FormatUint(rank, 10)
	}
	return "c" + strconv.FormatUint(rank, 10)
}

// regionNames are n region names: the reference deployment's three, then
// region-3, region-4, ...
func regionNames(n int) []string {
	names := []string{"us-east", "eu-west", "ap-south"}
	for i := len(names); i < n; i++ {
		names = append(names, fmt.Sprintf("region-%d", i))
	}
	return names[:n]
}

// wanDelays are the one-way delays of spec between every two regions.
func wanDelays(spec string, names []string) (map[[2]string]time.Duration, error) {
	out := map[[2]string]time.Duration{}
	var d time.Duration
	switch spec {
	case "0", "":
		return out, nil
	case "spread":
	default:
		var err error
		if d, err = time.ParseDuration(spec); err != nil || d < 0 || d > time.Second {
			return nil, fmt.Errorf("-scale.wan: must be 0, a duration up to 1s or spread, got %q", spec)
		}
		if d == 0 {
			return out, nil
		}
	}
	for i := range names {
		for j := i + 1; j < len(names); j++ {
			pd := d
			if spec == "spread" {
				pd = 50 * time.Millisecond
				if len(names) > 2 {
					pd += 100 * time.Millisecond * time.Duration(j-i-1) / time.Duration(len(names)-2)
				}
			}
			out[[2]string{names[i], names[j]}] = pd
		}
	}
	return out, nil
}

// TestConfigRejects: every bad knob is refused, naming its flag; the
// defaults are valid.
func TestConfigRejects(t *testing.T) {
	t.Parallel()
	good := configFromFlags()
	if err := good.validate(); err != nil {
		t.Fatalf("the defaults: %v", err)
	}
	for _, tt := range []struct {
		name   string
		mutate func(*config)
		flag   string
	}{
		{"one region", func(c *config) { c.regions = 1 }, "-scale.regions"},
		{"no keys", func(c *config) { c.keys = 0 }, "-scale.keys"},
		{"rate too high", func(c *config) { c.rate = 1 << 30 }, "-scale.rate"},
		{"no publishers", func(c *config) { c.publishers = 0 }, "-scale.publishers"},
		{"too many primaries", func(c *config) { c.primaries = 7 }, "-scale.primaries"},
		{"few check calls", func(c *config) { c.checkCalls = 10 }, "-scale.check-calls"},
		{"zipf 1", func(c *config) { c.zipf = 1 }, "-scale.zipf"},
		{"zipf negative", func(c *config) { c.zipf = -2 }, "-scale.zipf"},
		{"no duration", func(c *config) { c.duration = 0 }, "-scale.duration"},
		{"an hour", func(c *config) { c.duration = time.Hour }, "-scale.duration"},
		{"negative warm-up", func(c *config) { c.warmup = -time.Second }, "-scale.warmup"},
		{"interval too short", func(c *config) { c.interval = time.Millisecond }, "-scale.interval"},
		{"max-defer under the interval", func(c *config) { c.maxDefer = c.interval / 2 }, "-scale.max-defer"},
		{"wan not a duration", func(c *config) { c.wan = "far" }, "-scale.wan"},
		{"wan too long", func(c *config) { c.wan = "2s" }, "-scale.wan"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := good
			tt.mutate(&c)
			err := c.validate()
			if err == nil || !strings.Contains(err.Error(), tt.flag+":") {
				t.Fatalf("err = %v, want one naming %s", err, tt.flag)
			}
		})
	}
	shared, home := good, good
	shared.home, home.home = false, true
	if a, b := shared.client(0, 7), shared.client(1, 7); a != b {
		t.Errorf("one population: region 0's client of rank 7 is %s, region 1's %s", a, b)
	}
	if a, b := home.client(0, 7), home.client(1, 7); a == b || home.client(1, 70) == home.client(11, 0) {
		t.Errorf("-scale.home: regions 0 and 1 share the client %s of rank 7, or 1/70 and 11/0 collide", a)
	}
	d, err := wanDelays("spread", regionNames(4))
	if err != nil {
		t.Fatal(err)
	}
	got := []time.Duration{d[[2]string{"us-east", "eu-west"}], d[[2]string{"us-east", "ap-south"}], d[[2]string{"us-east", "region-3"}]}
	if want := []time.Duration{50 * time.Millisecond, 100 * time.Millisecond, 150 * time.Millisecond}; !slices.Equal(got, want) {
		t.Errorf("spread delays from us-east over 4 regions: %v, want %v", got, want)
	}
}
