// Package httplimit is net/http middleware that checks every request
// against limiterd and answers as DESIGN's client contract says: 429 with
// Retry-After when over the limit, 503 when a fail-closed rule cannot be
// decided or a lower priority request is shed (with Retry-After), and the
// quota headers on every decided response.
package httplimit

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/limiterd/limiterd/pkg/client"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// Checker decides attribute-based checks; *client.Client is one.
type Checker interface {
	CheckAttributes(ctx context.Context, a *limiterv1.Attributes, cost float64) (*limiterv1.CheckResponse, error)
}

// Identity is who made a request, as its authentication established it.
type Identity struct {
	APIKey string
	User   string
}

// Options configure Middleware. The zero Options check every request with
// no identity (so only rules keyed by ip or global apply), keyed by the
// connection's address, and fail open.
type Options struct {
	// Identity returns the authenticated identity of a request, typically
	// from its context, where the authentication middleware (which must run
	// before this one) put it. Never read it from a header the client sets:
	// a key the client chooses is a limit the client resets. Nil: none.
	Identity func(*http.Request) Identity
	// ClientIP returns the client's address, for rules keyed by ip; "" for
	// none. Nil: RemoteAddrIP, the connection's peer. Behind a proxy use
	// ForwardedIP with the proxies' addresses.
	ClientIP func(*http.Request) string
	// Plan returns the client's plan, for rules matching plans. Nil: none.
	Plan func(*http.Request) string
	// Extra returns named attributes, for key_by attr:NAME and
	// match.attributes. Nil: none.
	Extra func(*http.Request) map[string]string
	// Cost returns the request's cost, multiplying each rule's (0 means
	// 1). Nil: 1.
	Cost func(*http.Request) float64
	// Priority returns the request's priority class (critical, default,
	// sheddable, or limiterd's --priority.classes), sent with the check
	// (Concurrency's Acquire) through client.WithPriority. Take it from
	// what the service knows of the request (its route, its caller), never
	// from a header the client sets: a class the client chooses is a
	// reserve the client spends.
	// Nil: the context's (client.PriorityOf), else default.
	Priority func(*http.Request) string
	// FailClosed answers 503 when no decision could be had (limiterd
	// unreachable or too slow, or the check refused as invalid). By
	// default the request is served without quota headers: the limiter
	// must not be less available than what it protects. Either way, a
	// fail-closed rule that limiterd could not decide is a 503.
	FailClosed bool
	// Logger logs checks that got no decision (no client identities are
	// logged). Nil: slog.Default().
	Logger *slog.Logger
	// Now is the clock of X-RateLimit-Reset. Nil: time.Now.
	Now func() time.Time
	// OnLeaseLost, for Concurrency, is called when a request's context is
	// cancelled because its lease is gone or expired unrenewed, with the
	// cause (client.ErrLeaseGone, ErrLeaseExpired): count them with it.
	// It runs on the goroutine that renews, while the handler may still
	// be running. Nil: they are only logged.
	OnLeaseLost func(r *http.Request, cause error)
}

// Middleware checks each request with c before calling the next handler.
//
//   - allowed: the quota headers (SetHeaders), then the next handler;
//   - over the limit: 429 Too Many Requests with Retry-After (whole
//     seconds, rounded up, never 0) and the quota headers;
//   - refused only for the reserve a rule keeps for more important
//     priority classes (Reason RESERVED): 503 Service Unavailable with
//     Retry-After and the quota headers, since the service sheds load and
//     the client did nothing wrong;
//   - limiterd answered UNAVAILABLE (a fail-closed rule it could not
//     decide): 503 Service Unavailable, our problem rather than the client's;
//   - no decision (limiterd unreachable, too slow, or an error status): the
//     next handler without quota headers, or 503 with Options.FailClosed.
//
// The handlers it returns are safe for concurrent use when c and the
// functions of opts are.
//
// A Checker other than *client.Client should wrap client.ErrUnreachable in
// the errors of checks it could not deliver, or its UNAVAILABLE errors are
// all taken for fail-closed refusals.
func Middleware(c Checker, opts Options) func(http.Handler) http.Handler {
	opts = opts.withDefaults()
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			a, cost := opts.attributes(r)
			ctx := r.Context()
			if opts.Priority != nil {
				ctx = client.WithPriority(ctx, opts.Priority(r))
			}
			resp, err := c.CheckAttributes(ctx, a, cost)
			if err != nil {
				if opts.failed(w, r, err) {
					next.ServeHTTP(w, r)
				}
				return
			}
			SetHeaders(w.Header(), resp, opts.Now())
			if !resp.GetAllowed() {
				RefuseCheck(w, resp)
				return
			}
			next.ServeHTTP(w, r)
		})
	}
}

// RefuseCheck answers a refused check, after SetHeaders: 503 Service
// Unavailable when it was refused only for the reserve of more important
// priority classes (Reason RESERVED), otherwise 429 Too Many Requests.
func RefuseCheck(w http.ResponseWriter, resp *limiterv1.CheckResponse) {
	if resp.GetReason() == limiterv1.Reason_RESERVED {
		http.Error(w, "service busy: lower priority requests are shed", http.StatusServiceUnavailable)
		return
	}
	http.Error(w, "too many requests", http.StatusTooManyRequests)
}

func (opts Options) withDefaults() Options {
	if opts.ClientIP == nil {
		opts.ClientIP = RemoteAddrIP
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	return opts
}

// attributes are what a request is checked by, and its cost.
func (opts *Options) attributes(r *http.Request) (*limiterv1.Attributes, float64) {
	a := &limiterv1.Attributes{Ip: opts.ClientIP(r), Path: r.URL.Path, Method: r.Method}
	if opts.Identity != nil {
		id := opts.Identity(r)
		a.ApiKey, a.User = id.APIKey, id.User
	}
	if opts.Plan != nil {
		a.Plan = opts.Plan(r)
	}
	if opts.Extra != nil {
		a.Extra = opts.Extra(r)
	}
	var cost float64
	if opts.Cost != nil {
		cost = opts.Cost(r)
	}
	return a, cost
}

// failed answers a check that got no decision: 503 for a fail-closed
// refusal or with FailClosed; otherwise it reports that the request is to
// be served.
func (opts *Options) failed(w http.ResponseWriter, r *http.Request, err error) (serve bool) {
	if Refused(err) {
		http.Error(w, "rate limiter unavailable", http.StatusServiceUnavailable)
		return false
	}
	opts.Logger.Warn("rate limit check failed", "path", r.URL.Path, "fail_closed", opts.FailClosed,
		"code", status.Code(err).String(), "err", err)
	if opts.FailClosed {
		http.Error(w, "rate limiter unavailable", http.StatusServiceUnavailable)
		return false
	}
	return true
}

// Refused reports whether err is limiterd's refusal of a fail-closed rule
// it could not decide (UNAVAILABLE, answered), as opposed to no answer at
// all (client.ErrUnreachable).
func Refused(err error) bool {
	return status.Code(err) == codes.Unavailable && !errors.Is(err, client.ErrUnreachable)
}

// RemoteAddrIP is the host of the request's RemoteAddr: the connection's
// peer, which the client cannot choose.
func RemoteAddrIP(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return ""
	}
	return ip.Unmap().WithZone("").String()
}

// ForwardedIP returns a ClientIP for servers behind proxies: when the
// connection comes from one of trusted, the client is the rightmost
// X-Forwarded-For address that is not itself a trusted proxy; otherwise the
// connection's peer, whatever the header says. Entries left of the first
// untrusted one are the client's own claims and are never used.
func ForwardedIP(trusted ...netip.Prefix) func(*http.Request) string {
	isTrusted := func(ip netip.Addr) bool {
		for _, p := range trusted {
			if p.Contains(ip) {
				return true
			}
		}
		return false
	}
	return func(r *http.Request) string {
		peer := RemoteAddrIP(r)
		ip, err := netip.ParseAddr(peer)
		if err != nil || !isTrusted(ip) {
			return peer
		}
		hops := r.Header.Values("X-Forwarded-For")
		for i := len(hops) - 1; i >= 0; i-- {
			parts := strings.Split(hops[i], ",")
			for j := len(parts) - 1; j >= 0; j-- {
				hop, err := netip.ParseAddr(strings.TrimSpace(parts[j]))
				if err != nil {
					// A malformed entry: nothing left of it can be trusted.
					return ip.String()
				}
				hop = hop.Unmap().WithZone("")
				if !isTrusted(hop) {
					return hop.String()
				}
				ip = hop
			}
		}
		return ip.String()
	}
}
