package limiterd

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/limiterd/limiterd/internal/frontdoor/envoyrls"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// The attacks of the trust-and-bounds review, replayed against a limiterd
// process built from cmd/limiterd with its default bounds. Each says what
// it once did and asserts it is refused or bounded now; the figures are
// logged (go test -v -run TestAttack).

// samples reads the samples of an exposition at httpAddr whose series
// (name and labels) start with one of prefixes.
func samples(t *testing.T, httpAddr string, prefixes ...string) map[string]float64 {
	t.Helper()
	resp, err := http.Get("http://" + httpAddr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		for _, p := range prefixes {
			if strings.HasPrefix(line, p) {
				i := strings.LastIndexByte(line, ' ')
				v, err := strconv.ParseFloat(line[i+1:], 64)
				if err == nil {
					out[line[:i]] = v
				}
			}
		}
	}
	return out
}

// rawH2 opens an HTTP/2 connection to a gRPC listener without a gRPC
// client, as an attacker would: the preface and SETTINGS are written, and
// the framer decodes headers. Writes are buffered: flush bw.
func rawH2(t *testing.T, addr string, timeout time.Duration) (fr *http2.Framer, bw *bufio.Writer, c net.Conn) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(timeout))
	bw = bufio.NewWriterSize(c, 64<<10)
	if _, err := bw.WriteString(http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	fr = http2.NewFramer(bw, c)
	fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	fr.MaxHeaderListSize = 1 << 20
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	return fr, bw, c
}

// checkHeaders encodes the request headers of a Check call to addr.
func checkHeaders(enc *hpack.Encoder, addr string) {
	for _, h := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":path", "/limiter.v1.Limiter/Check"},
		{":authority", addr}, {"content-type", "application/grpc"}, {"te", "trailers"}} {
		_ = enc.WriteField(hpack.HeaderField{Name: h[0], Value: h[1]})
	}
}

// TestAttackStreamFlood: one TCP connection opening HEADERS-only Check
// streams (100,000 once made 100,015 goroutines, RSS 561 -> 1,368 MB). Past
// --grpc.max-concurrent-streams (1024) every new stream is refused with
// RST_STREAM(REFUSED_STREAM), so goroutines and memory stay bounded. It
// opens 20,000 streams, 19 times the bound; LIMITER_ATTACK_STREAMS=100000
// replays the docs' figure.
func TestAttackStreamFlood(t *testing.T) {
	grpcAddr, httpAddr := limiterdProcess(t, "--rules.file", "testdata/rules.yml")
	before := samples(t, httpAddr, "go_goroutines", "process_resident_memory_bytes")
	fr, bw, c := rawH2(t, grpcAddr, 60*time.Second)
	var refused, goaway atomic.Int64
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.RSTStreamFrame:
				if f.ErrCode == http2.ErrCodeRefusedStream {
					refused.Add(1)
				}
			case *http2.GoAwayFrame:
				goaway.Add(1)
			}
		}
	}()
	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	streams := envInt(t, "LIMITER_ATTACK_STREAMS", 20_000)
	if streams <= DefaultGRPCMaxStreams {
		t.Fatalf("LIMITER_ATTACK_STREAMS=%d: want more than the %d streams allowed", streams, DefaultGRPCMaxStreams)
	}
	for i := range streams {
		block.Reset()
		checkHeaders(enc, grpcAddr)
		if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: uint32(2*i + 1), BlockFragment: block.Bytes(), EndHeaders: true}); err != nil {
			t.Fatalf("stream %d: %v", i, err)
		}
	}
	if err := bw.Flush(); err != nil {
		t.Fatal(err)
	}
	// Every stream past the limit is refused; the first 1024 wait for a
	// request body that never comes.
	deadline := time.Now().Add(30 * time.Second)
	for refused.Load() < streams-DefaultGRPCMaxStreams && goaway.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	during := samples(t, httpAddr, "go_goroutines", "process_resident_memory_bytes")
	t.Logf("%d streams on one connection: %d refused, %d GOAWAY; goroutines %v -> %v, RSS %.0f -> %.0f MB",
		streams, refused.Load(), goaway.Load(), before["go_goroutines"], during["go_goroutines"],
		before["process_resident_memory_bytes"]/1e6, during["process_resident_memory_bytes"]/1e6)
	if got := refused.Load(); got < streams-DefaultGRPCMaxStreams && goaway.Load() == 0 {
		t.Fatalf("%d streams refused and no GOAWAY; want the %d past the limit refused", got, streams-DefaultGRPCMaxStreams)
	}
	if g := during["go_goroutines"]; g > before["go_goroutines"]+DefaultGRPCMaxStreams+200 {
		t.Fatalf("%v goroutines during the flood (%v before): more than one per allowed stream", g, before["go_goroutines"])
	}
	if rss := during["process_resident_memory_bytes"]; rss > before["process_resident_memory_bytes"]+200e6 {
		t.Fatalf("RSS grew from %.0f to %.0f MB", before["process_resident_memory_bytes"]/1e6, rss/1e6)
	}
	c.Close()
	<-readDone
	// The daemon still answers.
	cc, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	if _, err := rlsv3.NewRateLimitServiceClient(cc).ShouldRateLimit(context.Background(), &rlsv3.RateLimitRequest{Domain: "x",
		Descriptors: []*ratelimitv3.RateLimitDescriptor{{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{{Key: "k", Value: "v"}}}}}); err != nil {
		t.Fatalf("a check after the flood: %v", err)
	}
}

// TestAttackRLSAmplification: one ShouldRateLimit of 100,000 descriptors
// (3.7 MB; once: 3.8 CPU-seconds, a 6 MB answer, 100,000 buckets) is
// refused before any work, and the largest request accepted (64
// descriptors of 32 entries, within the 1 MiB message bound) costs
// milliseconds and makes at most 64 buckets.
func TestAttackRLSAmplification(t *testing.T) {
	grpcAddr, httpAddr := limiterdProcess(t, "--rules.file", "testdata/envoy_rules.yml")
	cc, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(16<<20)))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	rls := rlsv3.NewRateLimitServiceClient(cc)
	ctx := context.Background()
	desc := func(i, entries, valueBytes int) *ratelimitv3.RateLimitDescriptor {
		d := &ratelimitv3.RateLimitDescriptor{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{
			{Key: "generic_key", Value: "per-key"}, {Key: "api_key", Value: fmt.Sprintf("key-%d", i)}}}
		for j := len(d.Entries); j < entries; j++ {
			d.Entries = append(d.Entries, &ratelimitv3.RateLimitDescriptor_Entry{Key: fmt.Sprint("x", j), Value: strings.Repeat("v", valueBytes)})
		}
		return d
	}
	buckets := func() float64 {
		return samples(t, httpAddr, `limiter_memory_buckets{store="embedded"}`)[`limiter_memory_buckets{store="embedded"}`]
	}

	huge := &rlsv3.RateLimitRequest{Domain: "edge"}
	for i := range 100_000 {
		huge.Descriptors = append(huge.Descriptors, desc(i, 2, 0))
	}
	_, err = rls.ShouldRateLimit(ctx, huge)
	t.Logf("100,000 descriptors (%d bytes): %v", proto.Size(huge), err)
	if c := status.Code(err); c != codes.ResourceExhausted && c != codes.InvalidArgument {
		t.Fatalf("100,000 descriptors: %v; want RESOURCE_EXHAUSTED (over 1 MiB) or INVALID_ARGUMENT", err)
	}
	over := &rlsv3.RateLimitRequest{Domain: "edge"}
	for i := range envoyrls.MaxDescriptors + 1 {
		over.Descriptors = append(over.Descriptors, desc(i, 2, 0))
	}
	if _, err := rls.ShouldRateLimit(ctx, over); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "descriptors") {
		t.Fatalf("65 descriptors: %v; want INVALID_ARGUMENT naming descriptors", err)
	}
	if n := buckets(); n != 0 {
		t.Fatalf("%v buckets after refused requests, want 0", n)
	}

	// The largest accepted: 64 descriptors of 32 entries, each 480-byte
	// value, just under 1 MiB.
	largest := &rlsv3.RateLimitRequest{Domain: "edge"}
	for i := range envoyrls.MaxDescriptors {
		largest.Descriptors = append(largest.Descriptors, desc(i, 32, 480))
	}
	const rounds = 50
	cpu0 := samples(t, httpAddr, "process_cpu_seconds_total")["process_cpu_seconds_total"]
	var answer int
	for r := range rounds {
		for i, d := range largest.Descriptors {
			d.Entries[1].Value = fmt.Sprintf("key-%d-%d", r, i) // new buckets every round
		}
		resp, err := rls.ShouldRateLimit(ctx, largest)
		if err != nil {
			t.Fatalf("the largest request (%d bytes): %v", proto.Size(largest), err)
		}
		if len(resp.GetStatuses()) != envoyrls.MaxDescriptors {
			t.Fatalf("%d statuses for %d descriptors", len(resp.GetStatuses()), envoyrls.MaxDescriptors)
		}
		answer = proto.Size(resp)
	}
	cpu := samples(t, httpAddr, "process_cpu_seconds_total")["process_cpu_seconds_total"] - cpu0
	n := buckets()
	t.Logf("largest accepted request: %d bytes, answer %d bytes, %.2f ms of limiterd CPU each (%d rounds), %v buckets made",
		proto.Size(largest), answer, cpu*1000/rounds, rounds, n)
	if n > rounds*envoyrls.MaxDescriptors {
		t.Fatalf("%v buckets after %d requests of %d descriptors", n, rounds, envoyrls.MaxDescriptors)
	}
	if answer > 64<<10 {
		t.Fatalf("an answer of %d bytes to the largest request", answer)
	}
}

// envInt is the integer in environment variable name, or def.
func envInt(t *testing.T, name string, def int64) int64 {
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return n
}

// TestAttackEmbeddedStoreFlood: distinct keys on an hour's sliding log
// (1.12M once took the embedded store from 21 to 428 MB of RSS, held for
// the hour). The store stays within --memory.max-bytes, and the process
// within it plus its own working set. LIMITER_ATTACK_KEYS and
// LIMITER_ATTACK_MAX_BYTES (0: the default cap) change the flood, for the
// figure of docs/security.md.
func TestAttackEmbeddedStoreFlood(t *testing.T) {
	keys, maxBytes := envInt(t, "LIMITER_ATTACK_KEYS", 150_000), envInt(t, "LIMITER_ATTACK_MAX_BYTES", 16<<20)
	args := []string{"--rules.file", "testdata/rules.yml"}
	if maxBytes > 0 {
		args = append(args, "--memory.max-bytes", strconv.FormatInt(maxBytes, 10))
	}
	grpcAddr, httpAddr := limiterdProcess(t, args...)
	const (
		rss   = "process_resident_memory_bytes"
		bytes = `limiter_memory_bytes{store="embedded"}`
		capB  = `limiter_memory_max_bytes{store="embedded"}`
		evict = `limiter_memory_evictions_total{store="embedded"}`
	)
	before := samples(t, httpAddr, rss)
	client := limiterv1.NewLimiterClient(dial(t, grpcAddr))
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for range 16 {
		wg.Go(func() {
			for i := next.Add(1); i <= keys; i = next.Add(1) {
				resp, err := client.Check(context.Background(), &limiterv1.CheckRequest{RuleId: "log", Key: fmt.Sprint("flood:", i)})
				if err == nil && !resp.GetAllowed() {
					err = fmt.Errorf("flood key %d refused on its first check", i)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	after := samples(t, httpAddr, rss, "limiter_memory_")
	t.Logf("%d distinct keys: store %.1f MB counted (cap %.1f MB), %v evictions; RSS %.0f -> %.0f MB",
		keys, after[bytes]/1e6, after[capB]/1e6, after[evict], before[rss]/1e6, after[rss]/1e6)
	if after[bytes] > after[capB] || after[bytes] == 0 {
		t.Fatalf("the store counts %v bytes, cap %v", after[bytes], after[capB])
	}
	if after[rss] > before[rss]+2*after[capB]+64e6 {
		t.Fatalf("RSS grew from %.0f to %.0f MB for a store capped at %.0f MB", before[rss]/1e6, after[rss]/1e6, after[capB]/1e6)
	}
}

// TestAttackHugeHeaders: a client that ignores the advertised header list
// size and sends 1 MiB of metadata on a Check stream is refused (its
// stream or its connection), not given a handler, and the daemon serves
// the next client.
func TestAttackHugeHeaders(t *testing.T) {
	grpcAddr, _ := limiterdProcess(t, "--rules.file", "testdata/rules.yml")
	fr, bw, _ := rawH2(t, grpcAddr, 20*time.Second)
	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	checkHeaders(enc, grpcAddr)
	for i := range 64 {
		_ = enc.WriteField(hpack.HeaderField{Name: fmt.Sprint("x-pad-", i), Value: strings.Repeat("p", 16<<10), Sensitive: true})
	}
	defer func() {
		cc := dial(t, grpcAddr)
		if _, err := limiterv1.NewLimiterClient(cc).Check(context.Background(), &limiterv1.CheckRequest{RuleId: "tb", Key: "k"}); err != nil {
			t.Fatalf("a check after the attack: %v", err)
		}
	}()
	frag := block.Bytes()
	const chunk = 16 << 10
	err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: frag[:chunk]})
	for off := chunk; err == nil && off < len(frag); off += chunk {
		end := min(off+chunk, len(frag))
		err = fr.WriteContinuation(1, end == len(frag), frag[off:end])
	}
	if err == nil {
		err = bw.Flush()
	}
	if ne := net.Error(nil); errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("1 MiB of headers not taken in 20 s: %v", err)
	}
	if err != nil {
		// The server closed the connection while the headers came.
		t.Logf("1 MiB of headers: the connection was closed while they were written (%v)", err)
		return
	}
	for {
		f, err := fr.ReadFrame()
		if ne := net.Error(nil); errors.As(err, &ne) && ne.Timeout() {
			t.Fatalf("no answer to 1 MiB of headers in 20 s: %v", err)
		}
		if err != nil {
			t.Logf("1 MiB of headers: the connection was closed (%v)", err)
			return
		}
		switch f := f.(type) {
		case *http2.MetaHeadersFrame:
			if f.StreamID == 1 {
				st := f.PseudoValue("status")
				grpcStatus := ""
				for _, h := range f.RegularFields() {
					if h.Name == "grpc-status" {
						grpcStatus = h.Value
					}
				}
				t.Logf("1 MiB of headers: HTTP %s, grpc-status %s", st, grpcStatus)
				if grpcStatus == "" || grpcStatus == "0" {
					t.Fatalf("1 MiB of headers answered grpc-status %q", grpcStatus)
				}
				return
			}
		case *http2.RSTStreamFrame:
			t.Logf("1 MiB of headers: RST_STREAM %v", f.ErrCode)
			return
		case *http2.GoAwayFrame:
			t.Logf("1 MiB of headers: GOAWAY %v", f.ErrCode)
			return
		}
	}
}
