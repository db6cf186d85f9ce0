// Package natsauth makes the NATS identities of a deployment and what each
// may publish and subscribe: one nkey user per limiterd fleet and per
// reconciler of each region, and one admin writer, the only identity that
// may write the rules bucket. It renders them as a nats-server
// authorization block (Config) and writes each identity's seed (Write).
//
// What the permissions guarantee: a region's flushes (limiter.local.<r>)
// come only from its limiterd, its relayed spends
// (limiter.relay.<r>.<partition>) and
// its retries (limiter.retry.<r>.>) only from its reconciler, and rules
// only from the admin writer; a reconciler creates and updates
// only its own region's streams; no daemon may delete, purge or (limiterd)
// update a stream or a consumer. The JetStream
// API subjects are those nats.go's jetstream package (v1.55) sends for
// what each daemon does; a test runs the daemons against a server with
// exactly these permissions.
package natsauth

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/nats-io/nkeys"

	"github.com/limiterd/limiterd/internal/natsconn"
	"github.com/limiterd/limiterd/internal/rulesource"
	"github.com/limiterd/limiterd/pkg/gossip"
	"github.com/limiterd/limiterd/pkg/region"
)

// Role is what an identity is for.
type Role string

// The roles.
const (
	// RoleLimiterd is every limiterd of one region: it publishes the
	// region's flushes and reads the rules.
	RoleLimiterd Role = "limiterd"
	// RoleReconciler is every reconciler of one region: it sets up the
	// streams, relays the flushes, applies the other regions' spends and
	// reads the rules.
	RoleReconciler Role = "reconciler"
	// RoleAdmin is the admin API's writer of the rules bucket, for every
	// region (the bucket is one for the deployment).
	RoleAdmin Role = "admin"
)

// ConfigFile is the name of the authorization block Write writes.
const ConfigFile = "auth.conf"

// Permissions are an identity's allow and deny lists; a deny wins over an
// allow. An empty allow list allows nothing.
type Permissions struct {
	PublishAllow, PublishDeny     []string
	SubscribeAllow, SubscribeDeny []string
}

// Identity is one nkey user and its permissions.
type Identity struct {
	// Name is limiterd-<region>, reconciler-<region> or admin; Write names
	// the seed file <Name>.nk.
	Name   string
	Role   Role
	Region string // empty for RoleAdmin
	// PublicKey is the user's nkey (U...), Seed its private seed (SU...).
	PublicKey string
	Seed      []byte
	// Kept: Write found the seed in its directory and kept it.
	Kept bool
	Permissions
}

// kvStream is the stream behind the rules bucket.
var kvStream = "KV_" + rulesource.DefaultBucket

const api = "$JS.API."

// rulesReader are the subjects of reading and watching the rules bucket:
// look it up, watch it (an ordered push consumer, created again after a
// gap and deleted when the watch stops, with flow control replies), and
// get one key directly.
func rulesReader() []string {
	return []string{
		api + "INFO",
		api + "STREAM.INFO." + kvStream,
		api + "CONSUMER.CREATE." + kvStream,
		api + "CONSUMER.CREATE." + kvStream + ".>",
		api + "CONSUMER.DELETE." + kvStream + ".>",
		api + "DIRECT.GET." + kvStream,
		api + "DIRECT.GET." + kvStream + ".>",
		api + "STREAM.MSG.GET." + kvStream,
		"$JS.FC." + kvStream + ".>",
	}
}

// destructive are the JetStream API calls no daemon makes; they are
// denied outright, whatever an allow list holds: deleting or purging a
// stream or its messages, deleting the durable consumers of the spend
// streams of regions, and the server and cluster calls. (A rules reader
// deletes the ephemeral consumer of a watch it stops.)
func destructive(regions []string) []string { return destructiveBut(regions, "") }

// destructiveBut is destructive without the deletes of the consumers of
// keep's local stream: the reconcilers of region keep delete their relay's
// consumers there.
func destructiveBut(regions []string, keep string) []string {
	out := []string{
		api + "STREAM.DELETE.>", api + "STREAM.PURGE.>", api + "STREAM.MSG.DELETE.>",
		api + "ACCOUNT.PURGE.>", api + "SERVER.>", api + "META.>",
	}
	for _, r := range regions {
		for _, stream := range []string{gossip.LocalStream(r), gossip.RegionStream(r), gossip.InStream(r), gossip.RetryStream(r)} {
			if r == keep && stream == gossip.LocalStream(r) {
				continue
			}
			out = append(out, api+"CONSUMER.DELETE."+stream+".>")
		}
	}
	return out
}

// otherBuckets are the writes of the buckets a reconciler of self does not
// write: the rules bucket and the other regions' apply leases.
func otherBuckets(self string, regions []string) []string {
	out := []string{"$KV." + rulesource.DefaultBucket + ".>"}
	for _, r := range regions {
		if r != self {
			out = append(out, "$KV."+gossip.ApplyBucket(r)+".>")
		}
	}
	return out
}

// inbox is where the replies to identity come (JetStream API answers,
// publish acks, messages fetched from a pull consumer): its own inbox
// prefix alone, so no identity reads another's.
func inbox(identity string) []string { return []string{natsconn.InboxPrefix(identity) + ".>"} }

// PermissionsFor returns the permissions of role in region, in a
// deployment of regions (every other region is a spends source).
func PermissionsFor(role Role, self string, regions []string) Permissions {
	switch role {
	case RoleLimiterd:
		return Permissions{
			PublishAllow: append([]string{gossip.LocalSubject(self)}, rulesReader()...),
			PublishDeny: append([]string{
				"$KV.>", gossip.RelaySubjectPrefix + ">", gossip.RetrySubjectPrefix + ">",
				api + "STREAM.CREATE.>", api + "STREAM.UPDATE.>",
			}, destructive(regions)...),
			SubscribeAllow: inbox(natsconn.IdentityName(string(role), self)),
		}
	case RoleReconciler:
		local, spends, in, retry := gossip.LocalStream(self), gossip.RegionStream(self), gossip.InStream(self), gossip.RetryStream(self)
		pub := []string{gossip.PartitionSubjects(self), gossip.RetrySubjectPrefix + self + ".>"}
		for _, stream := range []string{local, spends, in, retry} {
			pub = append(pub, api+"STREAM.INFO."+stream, api+"STREAM.CREATE."+stream, api+"STREAM.UPDATE."+stream)
		}
		// The inbound stream's consumers are listed (their backlogs). Its
		// apply consumers are ephemeral, named by their reader: pulled,
		// never acknowledged (the position is kept in Redis), their info
		// read (and the ack floor of a durable one of an earlier release,
		// where a partition with no position starts), never deleted (they
		// go once idle).
		pub = append(pub, api+"CONSUMER.LIST."+in, api+"CONSUMER.INFO."+in+".*", api+"CONSUMER.MSG.NEXT."+in+".*")
		// The relay's consumers of the local stream: one per holding of
		// the relay's lease, named by it; a holder deletes the others
		// (and the durable "relay" of earlier releases). The relay reads
		// each partition's last message of the spends stream.
		pub = append(pub, consumer(local, "*", "")...)
		pub = append(pub, api+"CONSUMER.NAMES."+local, api+"CONSUMER.DELETE."+local+".*",
			api+"STREAM.MSG.GET."+spends, api+"DIRECT.GET."+spends, api+"DIRECT.GET."+spends+".>")
		// The region's bucket of apply leases: made, read (directly) and
		// written; its own alone.
		bucket := gossip.ApplyBucket(self)
		pub = append(pub, "$KV."+bucket+".>", api+"STREAM.INFO.KV_"+bucket, api+"STREAM.CREATE.KV_"+bucket,
			api+"DIRECT.GET.KV_"+bucket, api+"DIRECT.GET.KV_"+bucket+".>", api+"STREAM.MSG.GET.KV_"+bucket)
		for _, src := range regions {
			if src != self {
				// The other regions' spends streams are looked up (never
				// written): an answer says a stalled source of the inbound
				// stream may be set up again now; and a message get by
				// start time finds the sequence a source added starts at.
				pub = append(pub, api+"STREAM.INFO."+gossip.RegionStream(src), api+"STREAM.MSG.GET."+gossip.RegionStream(src))
				// Apply consumers of one partition each, as many as any
				// --apply.partitions allows.
				for p := range gossip.MaxPartitions {
					pub = append(pub, api+"CONSUMER.CREATE."+in+".*."+gossip.PartitionSubject(src, p))
				}
				pub = append(pub, consumer(retry, "retry-"+self+"-from-"+src, gossip.RetrySubjectPrefix+self+"."+src+".>")...)
			}
		}
		return Permissions{
			PublishAllow:   append(pub, rulesReader()...),
			PublishDeny:    append(append([]string{gossip.LocalSubjectPrefix + ">"}, otherBuckets(self, regions)...), destructiveBut(regions, self)...),
			SubscribeAllow: inbox(natsconn.IdentityName(string(role), self)),
		}
	case RoleAdmin:
		return Permissions{
			PublishAllow: []string{
				"$KV." + rulesource.DefaultBucket + ".>",
				api + "INFO",
				api + "STREAM.INFO." + kvStream, api + "STREAM.CREATE." + kvStream,
				api + "DIRECT.GET." + kvStream, api + "DIRECT.GET." + kvStream + ".>", api + "STREAM.MSG.GET." + kvStream,
			},
			PublishDeny: append([]string{gossip.LocalSubjectPrefix + ">",
				gossip.RelaySubjectPrefix + ">", gossip.RetrySubjectPrefix + ">"}, destructive(regions)...),
			SubscribeAllow: inbox(natsconn.IdentityName(string(role), "")),
		}
	}
	return Permissions{}
}

// consumer are the subjects of using one durable pull consumer: create or
// update it (with its filter subject, if any), read its info, fetch, and
// acknowledge (ack, nak, term) its messages.
func consumer(stream, name, filter string) []string {
	create := api + "CONSUMER.CREATE." + stream + "." + name
	if filter != "" {
		create += "." + filter
	}
	return []string{
		create,
		api + "CONSUMER.INFO." + stream + "." + name,
		api + "CONSUMER.MSG.NEXT." + stream + "." + name,
		"$JS.ACK." + stream + "." + name + ".>",
	}
}

// Generate makes fresh nkey users for regions: a limiterd and a reconciler
// identity per region, then the admin writer.
func Generate(regions []string) ([]Identity, error) {
	return generate(regions, func(string) ([]byte, error) { return nil, nil })
}

// generate is Generate with the seed of each identity that seedOf gives
// (nil: a fresh one).
func generate(regions []string, seedOf func(name string) ([]byte, error)) ([]Identity, error) {
	if len(regions) == 0 {
		return nil, errors.New("regions: at least one")
	}
	for i, r := range regions {
		if err := region.ValidateName(r); err != nil {
			return nil, fmt.Errorf("regions[%d]: %w", i, err)
		}
		if slices.Index(regions, r) != i {
			return nil, fmt.Errorf("regions[%d]: %q is listed twice", i, r)
		}
	}
	var ids []Identity
	add := func(name string, role Role, r string) error {
		seed, err := seedOf(name)
		if err != nil {
			return err
		}
		kept := seed != nil
		var kp nkeys.KeyPair
		if kept {
			kp, err = nkeys.FromSeed(seed)
		} else {
			kp, err = nkeys.CreateUser()
		}
		if err != nil {
			return err
		}
		pub, err := kp.PublicKey()
		if err != nil {
			return err
		}
		if seed, err = kp.Seed(); err != nil {
			return err
		}
		ids = append(ids, Identity{Name: name, Role: role, Region: r, PublicKey: pub, Seed: seed, Kept: kept,
			Permissions: PermissionsFor(role, r, regions)})
		return nil
	}
	for _, r := range regions {
		if err := add(natsconn.IdentityName(string(RoleLimiterd), r), RoleLimiterd, r); err != nil {
			return nil, err
		}
		if err := add(natsconn.IdentityName(string(RoleReconciler), r), RoleReconciler, r); err != nil {
			return nil, err
		}
	}
	if err := add(natsconn.IdentityName(string(RoleAdmin), ""), RoleAdmin, ""); err != nil {
		return nil, err
	}
	return ids, nil
}

// Config renders ids as a nats-server authorization block. With it the
// server refuses a client that presents none of these nkeys.
func Config(ids []Identity) string {
	var b strings.Builder
	b.WriteString("# NATS identities of limiterd (internal/natsauth). A client without one of\n")
	b.WriteString("# these nkeys is refused; each may publish and subscribe only what it lists.\n")
	b.WriteString("authorization {\n  users = [\n")
	for _, id := range ids {
		fmt.Fprintf(&b, "    # %s\n", id.Name)
		fmt.Fprintf(&b, "    { nkey: %s\n      permissions: {\n", id.PublicKey)
		fmt.Fprintf(&b, "        publish: { allow: %s\n                   deny: %s }\n", list(id.PublishAllow), list(id.PublishDeny))
		fmt.Fprintf(&b, "        subscribe: { allow: %s", list(id.SubscribeAllow))
		if len(id.SubscribeDeny) > 0 {
			fmt.Fprintf(&b, "\n                     deny: %s", list(id.SubscribeDeny))
		}
		b.WriteString(" }\n      }\n    }\n")
	}
	b.WriteString("  ]\n}\n")
	return b.String()
}

func list(subjects []string) string {
	q := make([]string, len(subjects))
	for i, s := range subjects {
		q[i] = strconv.Quote(s)
	}
	return "[" + strings.Join(q, ", ") + "]"
}

// SeedFile is the path Write gives the seed of the identity named name.
func SeedFile(dir, name string) string { return filepath.Join(dir, name+".nk") }

// WriteOption changes what Write does.
type WriteOption func(*writeOptions)

type writeOptions struct{ rotate bool }

// Rotate makes Write give every identity a fresh seed, also those whose
// seed it finds.
func Rotate() WriteOption { return func(o *writeOptions) { o.rotate = true } }

// Write writes the identities of regions into dir (made with mode 0700 if
// missing): the authorization block (ConfigFile) and each identity's seed
// (<name>.nk, mode 0600). An identity whose seed file is in dir already
// keeps that seed (Kept), unless Rotate: adding a region gives new seeds
// to its identities only, and every other daemon keeps the seed it runs
// with (the permissions in ConfigFile change for all). A seed file that is
// not one nkey user seed is an error naming it; seed files of identities
// regions no longer has are left alone.
func Write(dir string, regions []string, opts ...WriteOption) ([]Identity, error) {
	var o writeOptions
	for _, f := range opts {
		f(&o)
	}
	ids, err := generate(regions, func(name string) ([]byte, error) {
		if o.rotate {
			return nil, nil
		}
		return readSeed(SeedFile(dir, name))
	})
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	for _, id := range ids {
		if err := writeFile(SeedFile(dir, id.Name), append(id.Seed, '\n'), 0o600); err != nil {
			return nil, err
		}
	}
	if err := writeFile(filepath.Join(dir, ConfigFile), []byte(Config(ids)), 0o600); err != nil {
		return nil, err
	}
	return ids, nil
}

// readSeed reads the user seed in path: nil when there is no file.
func readSeed(path string) ([]byte, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	seed := []byte(strings.TrimSpace(string(data)))
	kp, err := nkeys.FromSeed(seed)
	if err != nil {
		return nil, fmt.Errorf("%s: not an nkey seed: %w (remove it, or use --rotate)", path, err)
	}
	if pub, _ := kp.PublicKey(); !strings.HasPrefix(pub, "U") {
		return nil, fmt.Errorf("%s: the seed of a key starting %s, not a user's (U...): remove it, or use --rotate", path, pub[:1])
	}
	return seed, nil
}

// writeFile writes data to path with mode perm, also when path exists
// with a wider mode.
func writeFile(path string, data []byte, perm os.FileMode) error {
	if err := os.WriteFile(path, data, perm); err != nil {
		return err
	}
	return os.Chmod(path, perm)
}
