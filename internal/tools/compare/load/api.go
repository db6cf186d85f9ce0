// Package load drives the systems with ghz and reads what each run cost:
// the config files of every system and ghz's request templates (config/),
// the protoset ghz reads, the checks of the answers with a Go client, and
// the measurement of one run (req/s, p99, CPU per call, Redis's time per
// command).
package load

import (
	"bytes"
	"context"
	"crypto/rand"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"text/template"

	"github.com/bufbuild/protocompile"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	limiterv1 "github.com/limiterd/limiterd/proto/limiter/v1"
)

// configFS holds the config files of every system and ghz's request
// templates; the tool writes them into its temporary folder.
//
//go:embed config
var configFS embed.FS

// limitPerSecond is the limit every system is given for each key, in each
// config file (the test holds them to it): far above what one key is ever
// sent (each request names a new key), so that nothing is refused.
const limitPerSecond = 1_000_000

// API is one gRPC method ghz drives.
type API struct {
	name string
	// method is ghz's --call; template the config file of its request.
	method   string
	template string
}

// The APIs of the systems.
var (
	RLS        = API{name: "Envoy RLS v3", method: "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit", template: "ghz-rls.json"}
	Check      = API{name: "limiter.v1 Check", method: "limiter.v1.Limiter/Check", template: "ghz-check.json"}
	Gubernator = API{name: "pb.gubernator.V1/GetRateLimits", method: "pb.gubernator.V1/GetRateLimits", template: "ghz-gubernator.json"}
	Health     = API{name: "grpc.health.v1 Health/Check", method: "grpc.health.v1.Health/Check", template: "ghz-health.json"}
)

// Name is how the report names a.
func (a API) Name() string { return a.name }

// decides reports whether a's calls are rate limit decisions (counted in
// limiterd's limiter_decisions_total).
func (a API) decides() bool { return a != Health }

// callData is the part of ghz's template data (ghz v0.93.0
// runner.CallData) a request template may use.
type callData struct {
	WorkerID           string
	RequestNumber      int64
	FullyQualifiedName string
	MethodName         string
	ServiceName        string
	InputName          string
	OutputName         string
	IsClientStreaming  bool
	IsServerStreaming  bool
	Timestamp          string
	TimestampUnix      int64
	TimestampUnixMilli int64
	TimestampUnixNano  int64
	UUID               string
}

// ghzFuncs are ghz's template functions, for parsing (not called).
var ghzFuncs = template.FuncMap{
	"newUUID":      newUUID,
	"randomString": func(int) string { return "" },
	"randomInt":    func(int, int) int { return 0 },
}

// runMark stands in a request template for the label of a ghz run: keys
// are the run's label and ghz's request number, so that each call of a
// run names a new key and no two runs against one system share one. (A
// random key, {{.UUID}}, costs ghz about 4 µs more CPU per call, taken
// from the servers on a machine they share.)
const runMark = "@run@"

// forRun is the request template src of the run labelled run.
func forRun(src []byte, run string) []byte {
	return bytes.ReplaceAll(src, []byte(runMark), []byte(run))
}

// fill executes the request template src of the run labelled run as ghz
// does for its call number n.
func fill(src []byte, run string, n int64) ([]byte, error) {
	t, err := template.New("call").Funcs(ghzFuncs).Option("missingkey=error").Parse(string(forRun(src, run)))
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	if err := t.Execute(&b, callData{WorkerID: "compare", RequestNumber: n, UUID: newUUID()}); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

func newUUID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// request is call n of the run labelled run of a, filled from a's
// template and decoded into its request message: typed, or gubernator's
// dynamic one from gub.
func request(a API, gub *protoregistry.Files, run string, n int64) (proto.Message, error) {
	src, err := fs.ReadFile(configFS, "config/"+a.template)
	if err != nil {
		return nil, err
	}
	data, err := fill(src, run, n)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", a.template, err)
	}
	var m proto.Message
	switch a {
	case RLS:
		m = &rlsv3.RateLimitRequest{}
	case Check:
		m = &limiterv1.CheckRequest{}
	case Health:
		m = &healthpb.HealthCheckRequest{}
	case Gubernator:
		if m, err = gubernatorMessage(gub, "GetRateLimitsReq"); err != nil {
			return nil, err
		}
	}
	if err := protojson.Unmarshal(data, m); err != nil {
		return nil, fmt.Errorf("%s as %s: %w", a.template, m.ProtoReflect().Descriptor().FullName(), err)
	}
	return m, nil
}

func gubernatorMessage(gub *protoregistry.Files, name protoreflect.Name) (*dynamicpb.Message, error) {
	if gub == nil {
		return nil, errors.New("no descriptors of gubernator's API")
	}
	d, err := gub.FindDescriptorByName(protoreflect.FullName("pb.gubernator." + name))
	if err != nil {
		return nil, err
	}
	md, ok := d.(protoreflect.MessageDescriptor)
	if !ok {
		return nil, fmt.Errorf("pb.gubernator.%s is not a message", name)
	}
	return dynamicpb.NewMessage(md), nil
}

// Verify makes n calls of a on conn, each with a request from a's ghz
// template (a new key each), and checks that each answer admits the call
// under the compare limit: that the config was loaded, the request
// matched it, and the store decided.
func (ru *Runner) Verify(ctx context.Context, a API, conn *grpc.ClientConn, n int) error {
	for i := range n {
		req, err := request(a, ru.gub, "verify", int64(i))
		if err != nil {
			return err
		}
		if err := call(ctx, a, conn, req); err != nil {
			return fmt.Errorf("%s: %w", a.method, err)
		}
	}
	return nil
}

func call(ctx context.Context, a API, conn *grpc.ClientConn, req proto.Message) error {
	switch a {
	case RLS:
		resp, err := rlsv3.NewRateLimitServiceClient(conn).ShouldRateLimit(ctx, req.(*rlsv3.RateLimitRequest))
		if err != nil {
			return err
		}
		st := resp.GetStatuses()
		if resp.GetOverallCode() != rlsv3.RateLimitResponse_OK || len(st) != 1 || st[0].GetCode() != rlsv3.RateLimitResponse_OK {
			return fmt.Errorf("not OK: %v", resp)
		}
		if l := st[0].GetCurrentLimit(); l.GetRequestsPerUnit() != limitPerSecond || l.GetUnit() != rlsv3.RateLimitResponse_RateLimit_SECOND {
			return fmt.Errorf("descriptor's limit %v, want %d per second: the config did not match", l, limitPerSecond)
		}
	case Check:
		resp, err := limiterv1.NewLimiterClient(conn).Check(ctx, req.(*limiterv1.CheckRequest))
		if err != nil {
			return err
		}
		if !resp.GetAllowed() || resp.GetLimit() != limitPerSecond {
			return fmt.Errorf("not allowed under the limit %d: %v", limitPerSecond, resp)
		}
	case Health:
		resp, err := healthpb.NewHealthClient(conn).Check(ctx, req.(*healthpb.HealthCheckRequest))
		if err != nil {
			return err
		}
		if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
			return fmt.Errorf("not serving: %v", resp)
		}
	case Gubernator:
		// The response type is in the file of the request's.
		md := req.ProtoReflect().Descriptor().ParentFile().Messages().ByName("GetRateLimitsResp")
		if md == nil {
			return errors.New("no GetRateLimitsResp beside GetRateLimitsReq")
		}
		resp := dynamicpb.NewMessage(md)
		if err := conn.Invoke(ctx, "/"+a.method, req, resp); err != nil {
			return err
		}
		return checkGubernator(resp)
	}
	return nil
}

// checkGubernator checks a GetRateLimitsResp: one response, UNDER_LIMIT
// (0), no error, the compare limit.
func checkGubernator(resp *dynamicpb.Message) error {
	md := resp.Descriptor()
	list := resp.Get(md.Fields().ByName("responses")).List()
	if list.Len() != 1 {
		return fmt.Errorf("%d responses, want 1", list.Len())
	}
	r := list.Get(0).Message()
	f := r.Descriptor().Fields()
	status := r.Get(f.ByName("status")).Enum()
	msg := r.Get(f.ByName("error")).String()
	limit := r.Get(f.ByName("limit")).Int()
	if status != 0 || msg != "" || limit != limitPerSecond {
		return fmt.Errorf("status %d, error %q, limit %d; want UNDER_LIMIT, no error, limit %d", status, msg, limit, limitPerSecond)
	}
	return nil
}

// protosetFiles are the files ghz needs, from the Go packages' registry:
// ghz reads a FileDescriptorSet (none of the systems serves reflection).
var protosetFiles = []protoreflect.FileDescriptor{
	rlsv3.File_envoy_service_ratelimit_v3_rls_proto,
	limiterv1.File_limiter_v1_limiter_proto,
	healthpb.File_grpc_health_v1_health_proto,
}

// protoset is a FileDescriptorSet of protosetFiles and their imports,
// each file after those it imports, then the files of extra.
func protoset(extra *descriptorpb.FileDescriptorSet) (*descriptorpb.FileDescriptorSet, error) {
	set := &descriptorpb.FileDescriptorSet{}
	seen := make(map[string]bool)
	var add func(fd protoreflect.FileDescriptor) error
	add = func(fd protoreflect.FileDescriptor) error {
		if seen[fd.Path()] {
			return nil
		}
		seen[fd.Path()] = true
		if fd.IsPlaceholder() {
			return fmt.Errorf("protoset: %s is not linked into this binary", fd.Path())
		}
		imports := fd.Imports()
		for i := range imports.Len() {
			if err := add(imports.Get(i).FileDescriptor); err != nil {
				return err
			}
		}
		set.File = append(set.File, protodesc.ToFileDescriptorProto(fd))
		return nil
	}
	for _, fd := range protosetFiles {
		if err := add(fd); err != nil {
			return nil, err
		}
	}
	for _, f := range extra.GetFile() {
		if seen[f.GetName()] {
			continue
		}
		seen[f.GetName()] = true
		set.File = append(set.File, f)
	}
	// Every import resolves within the set: what ghz needs.
	if _, err := protodesc.NewFiles(set); err != nil {
		return nil, fmt.Errorf("protoset: %w", err)
	}
	return set, nil
}

// compileGubernator compiles config/gubernator.proto (in dir), in process,
// into a descriptor set (its imports included) and its registry.
func compileGubernator(ctx context.Context, dir string) (*descriptorpb.FileDescriptorSet, *protoregistry.Files, error) {
	c := protocompile.Compiler{Resolver: protocompile.WithStandardImports(&protocompile.SourceResolver{ImportPaths: []string{dir}})}
	compiled, err := c.Compile(ctx, "gubernator.proto")
	if err != nil {
		return nil, nil, fmt.Errorf("gubernator.proto: %w", err)
	}
	set := &descriptorpb.FileDescriptorSet{}
	seen := map[string]bool{}
	var add func(fd protoreflect.FileDescriptor)
	add = func(fd protoreflect.FileDescriptor) {
		if seen[fd.Path()] {
			return
		}
		seen[fd.Path()] = true
		for i := range fd.Imports().Len() {
			add(fd.Imports().Get(i).FileDescriptor)
		}
		set.File = append(set.File, protodesc.ToFileDescriptorProto(fd))
	}
	for _, fd := range compiled {
		add(fd)
	}
	files, err := protodesc.NewFiles(set)
	if err != nil {
		return nil, nil, fmt.Errorf("gubernator.proto: %w", err)
	}
	return set, files, nil
}

// writeConfig writes the embedded config folder into dir.
func writeConfig(dir string) error {
	return fs.WalkDir(configFS, "config", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := configFS.ReadFile(path)
		if err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(dir, filepath.Base(path)), b, 0o644)
	})
}
