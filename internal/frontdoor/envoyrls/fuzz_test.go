package envoyrls

import (
	"bytes"
	"context"
	"regexp"
	"testing"

	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/limiterd/limiterd/internal/engine"
	"github.com/limiterd/limiterd/internal/rules"
	"github.com/limiterd/limiterd/pkg/bucket"
)

// fuzzRules match on what Envoy sends: the domain, a path, a method, the
// client address and a generic key, so that fuzzed requests reach the
// store as well as the validation.
const fuzzRules = `rules:
  - id: by-ip
    capacity: 5
    refill_per_second: 1
    key_by: ip
    match: {domain: edge, path: /api/**}
  - id: by-key
    algorithm: sliding_log
    limit: 3
    window: 1m
    key_by: attr:generic_key
    match: {domain: edge}
  - id: by-user
    capacity: 2
    refill_per_second: 1
    key_by: user
    shadow: true
    match: {domain: edge, methods: [POST]}
`

// maxAnswerBytes bounds the encoded answer of one request: a status per
// descriptor (at most MaxDescriptors) and the quota headers.
const maxAnswerBytes = 64 << 10

// invalidField is how an invalid request's message must start: the path
// of the field at fault.
var invalidField = regexp.MustCompile(`^(domain|descriptors(\[\d+\])?|cost|key|attributes)[.:[ ]`)

// fuzzRequest builds a request from bytes: descriptors separated by 0,
// entries by 1, key and value by '='; the descriptors repeated repeat
// times (to cross the bounds), the request's and the first descriptor's
// hits_addend.
func fuzzRequest(domain string, data []byte, repeat uint8, hits uint32, descHits uint64) *rlsv3.RateLimitRequest {
	req := &rlsv3.RateLimitRequest{Domain: domain, HitsAddend: hits}
	var descs []*ratelimitv3.RateLimitDescriptor
	for _, d := range bytes.Split(data, []byte{0}) {
		desc := &ratelimitv3.RateLimitDescriptor{}
		for _, e := range bytes.Split(d, []byte{1}) {
			k, v, _ := bytes.Cut(e, []byte("="))
			desc.Entries = append(desc.Entries, &ratelimitv3.RateLimitDescriptor_Entry{Key: string(k), Value: string(v)})
		}
		descs = append(descs, desc)
	}
	if len(descs) > 0 && descHits > 0 {
		descs[0].HitsAddend = wrapperspb.UInt64(descHits)
	}
	for range max(1, int(repeat)) {
		req.Descriptors = append(req.Descriptors, descs...)
	}
	return req
}

// FuzzShouldRateLimit: any request either gets an answer with one status
// per descriptor and a bounded size, or is refused INVALID_ARGUMENT with a
// message naming the field; it never panics.
//
//	go test -run '^$' -fuzz FuzzShouldRateLimit -fuzztime 30s ./internal/frontdoor/envoyrls
func FuzzShouldRateLimit(f *testing.F) {
	set, err := rules.Parse("fuzz.yml", []byte(fuzzRules))
	if err != nil {
		f.Fatal(err)
	}
	e, err := engine.New(engine.Options{Store: bucket.NewMemory()}, set, prometheus.NewRegistry())
	if err != nil {
		f.Fatal(err)
	}
	s, err := New(e, Options{QuotaHeaders: true}, prometheus.NewRegistry())
	if err != nil {
		f.Fatal(err)
	}
	f.Add("edge", []byte("remote_address=192.0.2.1\x01:path=/api/x?y\x01:method=GET"), uint8(1), uint32(0), uint64(0))
	f.Add("edge", []byte("generic_key=tenant\x00user=bob\x01method=POST"), uint8(2), uint32(3), uint64(0))
	f.Add("edge", []byte("remote_address=2001:db8::1\x01path=/api/%2e%2e/a"), uint8(1), uint32(0), uint64(7))
	f.Add("", []byte("generic_key=g"), uint8(1), uint32(1), uint64(0))
	f.Add("edge", []byte("generic_key=g"), uint8(65), uint32(0), uint64(0))
	f.Add("edge", []byte("remote_address=not-an-ip"), uint8(1), uint32(1<<31), uint64(1<<40))
	f.Add("edge", []byte("=\x01=\x00\x00"), uint8(0), uint32(0), uint64(0))
	f.Add("other", []byte("generic_key=\xff\xfe"), uint8(3), uint32(0), uint64(0))
	f.Fuzz(func(t *testing.T, domain string, data []byte, repeat uint8, hits uint32, descHits uint64) {
		req := fuzzRequest(domain, data, repeat, hits, descHits)
		resp, err := s.ShouldRateLimit(context.Background(), req)
		if err != nil {
			st, _ := status.FromError(err)
			if st.Code() != codes.InvalidArgument {
				t.Fatalf("refused %v, want InvalidArgument: %v", st.Code(), err)
			}
			if !invalidField.MatchString(st.Message()) {
				t.Fatalf("the refusal does not name the field: %q", st.Message())
			}
			return
		}
		if len(req.Descriptors) > MaxDescriptors {
			t.Fatalf("%d descriptors answered, the bound is %d", len(req.Descriptors), MaxDescriptors)
		}
		if len(req.Descriptors) > 0 && len(resp.GetStatuses()) != len(req.Descriptors) {
			t.Fatalf("%d statuses for %d descriptors", len(resp.GetStatuses()), len(req.Descriptors))
		}
		if n := proto.Size(resp); n > maxAnswerBytes {
			t.Fatalf("answer of %d bytes, the bound is %d", n, maxAnswerBytes)
		}
	})
}
