package httplimit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/limiterd/limiterd/pkg/client"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// fakeAcquirer holds up to limit leases and records what was released.
type fakeAcquirer struct {
	mu       sync.Mutex
	limit    int
	held     map[string]bool
	next     int
	released []string
	ttl      time.Duration
	gone     bool  // Renew answers gone
	renewErr error // Renew fails with it (limiterd unreachable)
	renewals int
	// expires holds each lease's expiry when leases expire as a store's
	// do (nil: never): Acquire drops the expired ones first.
	expires map[string]time.Time
}

func (f *fakeAcquirer) AcquireAttributes(_ context.Context, _ *limiterv1.Attributes, _ float64) (*limiterv1.AcquireResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for id, at := range f.expires {
		if !time.Now().Before(at) {
			delete(f.held, id)
			delete(f.expires, id)
		}
	}
	if len(f.held) >= f.limit {
		return &limiterv1.AcquireResponse{Allowed: false, RetryAfterMs: 1500, RuleId: "reports", Limit: float64(f.limit)}, nil
	}
	f.next++
	id := "lease-" + string(rune('a'+f.next))
	f.held[id] = true
	if f.expires != nil {
		f.expires[id] = time.Now().Add(f.ttl)
	}
	return &limiterv1.AcquireResponse{Allowed: true, LeaseId: id, LeaseTtlMs: f.ttl.Milliseconds(), RuleId: "reports",
		Limit: float64(f.limit), Remaining: float64(f.limit - len(f.held))}, nil
}

func (f *fakeAcquirer) Release(_ context.Context, id string) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.released = append(f.released, id)
	ok := f.held[id]
	delete(f.held, id)
	return ok, nil
}

func (f *fakeAcquirer) Renew(_ context.Context, id string) (*limiterv1.RenewResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.renewals++
	if f.renewErr != nil {
		return nil, f.renewErr
	}
	if f.gone || !f.held[id] {
		return &limiterv1.RenewResponse{}, client.ErrLeaseGone
	}
	return &limiterv1.RenewResponse{Renewed: true}, nil
}

func (f *fakeAcquirer) heldCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.held)
}

func newFakeAcquirer(limit int) *fakeAcquirer {
	return &fakeAcquirer{limit: limit, held: map[string]bool{}, ttl: 30 * time.Second}
}

func TestConcurrencyReleasesWhenTheHandlerReturns(t *testing.T) {
	f := newFakeAcquirer(1)
	inside := 0
	h := Concurrency(f, Options{Logger: quiet})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		inside = f.heldCount()
		w.WriteHeader(200)
	}))
	for i := range 3 {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("GET", "/reports/1", nil))
		if rec.Code != 200 || inside != 1 || f.heldCount() != 0 {
			t.Fatalf("request %d: %d, %d held inside the handler, %d after", i, rec.Code, inside, f.heldCount())
		}
	}
}

func TestConcurrencyRefusal(t *testing.T) {
	f := newFakeAcquirer(0)
	h := Concurrency(f, Options{Logger: quiet})(http.HandlerFunc(okHandler))
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/reports/1", nil))
	if rec.Code != 429 || rec.Header().Get("Retry-After") != "2" {
		t.Fatalf("refusal: %d, Retry-After %q", rec.Code, rec.Header().Get("Retry-After"))
	}
}

// A panicking handler still releases, and the panic goes on to net/http.
func TestConcurrencyReleasesOnPanic(t *testing.T) {
	f := newFakeAcquirer(1)
	h := Concurrency(f, Options{Logger: quiet})(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {
		panic("handler bug")
	}))
	func() {
		defer func() {
			if recover() == nil {
				t.Error("the panic was swallowed")
			}
		}()
		h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/reports/1", nil))
	}()
	if f.heldCount() != 0 || len(f.released) != 1 {
		t.Fatalf("after a panic: %d held, released %v", f.heldCount(), f.released)
	}
}

// A client that disconnects cancels the request's context; the handler
// returns, and the lease is released on a context of its own.
func TestConcurrencyReleasesOnClientDisconnect(t *testing.T) {
	f := newFakeAcquirer(1)
	started := make(chan struct{})
	returned := make(chan struct{})
	srv := httptest.NewServer(Concurrency(f, Options{Logger: quiet})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer close(returned)
		close(started)
		<-r.Context().Done()
	})))
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, "GET", srv.URL+"/reports/1", nil)
	go func() {
		<-started
		cancel()
	}()
	if _, err := http.DefaultClient.Do(req); err == nil {
		t.Fatal("the request was not cancelled")
	}
	<-returned
	deadline := time.Now().Add(5 * time.Second)
	for f.heldCount() != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if f.heldCount() != 0 {
		t.Fatal("the lease of a disconnected client was not released")
	}
}

// A long request renews its lease; when the lease is gone the request's
// context is cancelled.
func TestConcurrencyRenewsAndStopsWhenGone(t *testing.T) {
	f := newFakeAcquirer(1)
	f.ttl = 40 * time.Millisecond
	var err error
	h := Concurrency(f, Options{Logger: quiet})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
			err = r.Context().Err()
		case <-time.After(100 * time.Millisecond):
		}
	}))
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/reports/1", nil))
	if err != nil || f.renewals < 2 {
		t.Fatalf("a long request: cancelled %v, %d renewals", err, f.renewals)
	}
	f.gone = true
	h.ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/reports/1", nil))
	if err == nil {
		t.Fatal("a request whose lease is gone was not cancelled")
	}
}

// TestConcurrencyStopsWhenRenewalsFail: with limiterd unreachable every
// renewal fails and the store expires the lease, so its slot is granted
// again; the first request's context is cancelled when its lease expires,
// so a limit of 1 never has two requests in flight.
func TestConcurrencyStopsWhenRenewalsFail(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFakeAcquirer(1)
		f.ttl = time.Second
		f.expires = map[string]time.Time{}
		f.renewErr = fmt.Errorf("%w: connection refused", client.ErrUnreachable)
		var inFlight, most atomic.Int32
		var stopped atomic.Int32 // handlers that saw their context end, by ErrLeaseExpired
		var lost atomic.Int32
		onLost := func(_ *http.Request, cause error) {
			if errors.Is(cause, ErrLeaseExpired) {
				lost.Add(1)
			}
		}
		h := Concurrency(f, Options{Logger: quiet, OnLeaseLost: onLost})(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			n := inFlight.Add(1)
			defer inFlight.Add(-1)
			for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
			}
			select {
			case <-r.Context().Done():
				if errors.Is(context.Cause(r.Context()), ErrLeaseExpired) {
					stopped.Add(1)
				}
			case <-time.After(10 * time.Second):
			}
		}))
		var wg sync.WaitGroup
		codes := make([]int, 2)
		for i := range 2 {
			wg.Go(func() {
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, httptest.NewRequest("GET", "/reports/1", nil))
				codes[i] = rec.Code
			})
			time.Sleep(1500 * time.Millisecond) // the first lease expired in the store
		}
		wg.Wait()
		if most.Load() > 1 {
			t.Errorf("%d requests in flight under a limit of 1 (the first kept running on an expired lease)", most.Load())
		}
		if stopped.Load() != 2 || codes[0] != 200 || codes[1] != 200 {
			t.Errorf("%d of 2 requests stopped at their lease's expiry; answers %v", stopped.Load(), codes)
		}
		if lost.Load() != 2 {
			t.Errorf("OnLeaseLost told of %d expired leases, want 2", lost.Load())
		}
		if f.renewals < 3 {
			t.Errorf("%d renewals tried before the expiry, want several", f.renewals)
		}
	})
}

// outcomeAcquirer is a fakeAcquirer that records the outcomes its
// releases report.
type outcomeAcquirer struct {
	*fakeAcquirer
	outcomes []client.Outcome
}

func (f *outcomeAcquirer) ReleaseOutcome(ctx context.Context, id string, o client.Outcome) (bool, error) {
	f.mu.Lock()
	f.outcomes = append(f.outcomes, o)
	f.mu.Unlock()
	return f.Release(ctx, id)
}

// TestConcurrencyReportsOutcome: with an OutcomeReleaser the release
// reports how long the handler ran, and a 5xx or a panic as failed.
func TestConcurrencyReportsOutcome(t *testing.T) {
	f := &outcomeAcquirer{fakeAcquirer: newFakeAcquirer(1)}
	for _, tc := range []struct {
		name   string
		h      http.HandlerFunc
		failed bool
	}{
		{"ok", func(w http.ResponseWriter, _ *http.Request) { time.Sleep(5 * time.Millisecond); fmt.Fprint(w, "ok") }, false},
		{"not found", func(w http.ResponseWriter, _ *http.Request) { http.NotFound(w, nil) }, false},
		{"early hints, then 503", func(w http.ResponseWriter, _ *http.Request) {
			w.WriteHeader(http.StatusEarlyHints)
			w.WriteHeader(http.StatusServiceUnavailable)
		}, true},
		{"panic", func(http.ResponseWriter, *http.Request) { panic("handler bug") }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			func() {
				defer func() { _ = recover() }()
				Concurrency(f, Options{Logger: quiet})(tc.h).ServeHTTP(httptest.NewRecorder(), httptest.NewRequest("GET", "/reports/1", nil))
			}()
			f.mu.Lock()
			defer f.mu.Unlock()
			o := f.outcomes[len(f.outcomes)-1]
			if o.Failed != tc.failed || o.Duration <= 0 || len(f.held) != 0 {
				t.Fatalf("outcome %+v, %d held; want failed %v, a duration, nothing held", o, len(f.held), tc.failed)
			}
			if tc.name == "ok" && o.Duration < 5*time.Millisecond {
				t.Fatalf("duration %v, the handler ran 5ms", o.Duration)
			}
		})
	}
}
