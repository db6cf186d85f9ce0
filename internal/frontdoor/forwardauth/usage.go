package forwardauth

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/limiterd/limiterd/internal/engine/request"
	"github.com/limiterd/limiterd/internal/engine/usage"
	"github.com/limiterd/limiterd/internal/frontdoor/checkapi"
	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// UsagePath is the usage route on the HTTP listener: GET
// /v1/usage?rule=ID&key=KEY[&cost=N][&priority=CLASS] answers GetUsage as
// JSON.
const UsagePath = "/v1/usage"

// UsageHandler is UsagePath: what a check of one rule and key would see
// now, without spending, as the JSON of limiter.v1.GetUsageResponse
// (field names as in the .proto). 400 names the bad parameter, 404 is an
// unknown rule, 503 a store or home region that did not answer. It is
// served behind the same secret as the forward-auth front door.
func UsageHandler(svc *checkapi.Service, log *slog.Logger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "no-store")
		if r.Method != http.MethodGet {
			w.Header().Set("Allow", http.MethodGet)
			usageError(w, http.StatusMethodNotAllowed, "method "+r.Method+" not allowed: use GET")
			return
		}
		q := r.URL.Query()
		req := &limiterv1.GetUsageRequest{RuleId: q.Get("rule"), Key: q.Get("key"), Priority: q.Get("priority")}
		if s := q.Get("cost"); s != "" {
			cost, err := strconv.ParseFloat(s, 64)
			if err != nil {
				usageError(w, http.StatusBadRequest, fmt.Sprintf("cost: %q is not a number", s))
				return
			}
			req.Cost = cost
		}
		resp, err := svc.Usage(r.Context(), req)
		if err != nil {
			var inv *request.InvalidError
			switch {
			case errors.Is(err, request.ErrUnknownRule):
				usageError(w, http.StatusNotFound, err.Error())
			case errors.As(err, &inv):
				usageError(w, http.StatusBadRequest, err.Error())
			case errors.Is(err, usage.ErrUnavailable), errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
				usageError(w, http.StatusServiceUnavailable, err.Error())
			default:
				log.Warn("usage failed", "err", err)
				usageError(w, http.StatusInternalServerError, err.Error())
			}
			return
		}
		body, err := protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}.Marshal(resp)
		if err != nil {
			usageError(w, http.StatusInternalServerError, err.Error())
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(body) // a client gone is nothing to answer
	})
}

// usageError answers {"error": msg} with code.
func usageError(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(struct { // a client gone is nothing to answer
		Error string `json:"error"`
	}{msg})
}
