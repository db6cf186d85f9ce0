package natsauth_test

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/limiterd/limiterd/internal/natsauth"
	"github.com/limiterd/limiterd/internal/testenv/natstest"
	"github.com/limiterd/limiterd/pkg/gossip"
)

func TestGenerateRefusesBadRegions(t *testing.T) {
	for _, tt := range []struct {
		name    string
		regions []string
		field   string
	}{
		{"none", nil, "regions"},
		{"bad name", []string{"us-east", "EU West"}, "regions[1]"},
		{"twice", []string{"us-east", "us-east"}, "regions[1]"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			_, err := natsauth.Generate(tt.regions)
			if err == nil || !strings.HasPrefix(err.Error(), tt.field+": ") {
				t.Fatalf("Generate = %v, want an error naming %s", err, tt.field)
			}
		})
	}
}

// TestLimiterdMayNotWrite: the allow lists of the read-only identities hold
// no subject that writes rules or destroys a stream, and the deny lists
// name them, whatever an allow list holds. (A reconciler writes its
// region's bucket of apply leases, and no other bucket.)
func TestLimiterdMayNotWrite(t *testing.T) {
	regions := []string{"us-east", "eu-west", "ap-south"}
	for _, role := range []natsauth.Role{natsauth.RoleLimiterd, natsauth.RoleReconciler} {
		p := natsauth.PermissionsFor(role, "us-east", regions)
		for _, s := range p.PublishAllow {
			for _, bad := range []string{"$KV.", "DELETE", "PURGE"} {
				// A watch of the rules deletes its own ephemeral consumer.
				// A reconciler deletes the relay consumers of its
				// region's local stream, and no other stream's.
				if strings.Contains(s, bad) && s != "$JS.API.CONSUMER.DELETE.KV_limiter_rules.>" &&
					(role != natsauth.RoleReconciler || (s != "$KV.LIMITER_APPLY_US_EAST.>" && s != "$JS.API.CONSUMER.DELETE.LIMITER_LOCAL_US_EAST.*")) {
					t.Errorf("%s may publish %s", role, s)
				}
			}
			if strings.HasPrefix(s, "limiter.") && !strings.HasSuffix(s, ".us-east") && !strings.HasPrefix(s, "limiter.retry.us-east.") &&
				s != "limiter.relay.us-east.*" {
				t.Errorf("%s of us-east may publish %s", role, s)
			}
		}
		kv := []string{"$KV.>"}
		if role == natsauth.RoleReconciler {
			kv = []string{"$KV.limiter_rules.>", "$KV.LIMITER_APPLY_EU_WEST.>", "$KV.LIMITER_APPLY_AP_SOUTH.>"}
		}
		deny := append(kv, "$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>", "$JS.API.CONSUMER.DELETE.LIMITER_SPENDS_US_EAST.>", "$JS.API.CONSUMER.DELETE.LIMITER_IN_EU_WEST.>",
			"$JS.API.CONSUMER.DELETE.LIMITER_LOCAL_AP_SOUTH.>")
		if role == natsauth.RoleLimiterd {
			deny = append(deny, "$JS.API.CONSUMER.DELETE.LIMITER_LOCAL_US_EAST.>")
		} else if slices.Contains(p.PublishDeny, "$JS.API.CONSUMER.DELETE.LIMITER_LOCAL_US_EAST.>") {
			t.Errorf("%s may not delete its relay's consumers", role)
		}
		for _, deny := range deny {
			if !slices.Contains(p.PublishDeny, deny) {
				t.Errorf("%s: %s not denied", role, deny)
			}
		}
	}
	if p := natsauth.PermissionsFor(natsauth.RoleLimiterd, "us-east", regions); !slices.Contains(p.PublishDeny, "$JS.API.STREAM.UPDATE.>") {
		t.Error("limiterd may update streams")
	}
}

// TestWriteStartsAServer: the written block locks a real server; each
// seed, mode 0600, logs in, and a client without one is refused.
func TestWriteStartsAServer(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "auth")
	ids, err := natsauth.Write(dir, []string{"us-east", "eu-west"})
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) != 5 {
		t.Fatalf("%d identities, want 5", len(ids))
	}
	conf, err := os.ReadFile(filepath.Join(dir, natsauth.ConfigFile))
	if err != nil {
		t.Fatal(err)
	}
	srv := natstest.NewServer(t, natstest.Config(string(conf)))
	if nc, err := nats.Connect(srv.URL()); err == nil {
		nc.Close()
		t.Error("a client without an nkey was let in")
	}
	for _, id := range ids {
		p := natsauth.SeedFile(dir, id.Name)
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want 0600", p, fi.Mode().Perm())
		}
		opt, err := nats.NkeyOptionFromSeed(p)
		if err != nil {
			t.Fatal(err)
		}
		nc, err := nats.Connect(srv.URL(), opt)
		if err != nil {
			t.Errorf("%s: %v", id.Name, err)
			continue
		}
		nc.Close()
	}
}

// TestReconcilerLooksUpOtherSpendsStreams: a reconciler may read the info
// of the other regions' spends streams (a stalled source is reset when its
// stream answers) and get a message of them (a source added starts at the
// sequence of a time), and never create or update them.
func TestReconcilerLooksUpOtherSpendsStreams(t *testing.T) {
	p := natsauth.PermissionsFor(natsauth.RoleReconciler, "us-east", []string{"us-east", "eu-west", "ap-south"})
	for _, s := range []string{"$JS.API.STREAM.INFO.LIMITER_SPENDS_EU_WEST", "$JS.API.STREAM.INFO.LIMITER_SPENDS_AP_SOUTH",
		"$JS.API.STREAM.MSG.GET.LIMITER_SPENDS_EU_WEST", "$JS.API.STREAM.MSG.GET.LIMITER_SPENDS_AP_SOUTH"} {
		if !slices.Contains(p.PublishAllow, s) {
			t.Errorf("reconciler of us-east may not publish %s", s)
		}
	}
	for _, s := range p.PublishAllow {
		for _, other := range []string{"EU_WEST", "AP_SOUTH"} {
			if strings.HasSuffix(s, "LIMITER_SPENDS_"+other) && !strings.HasPrefix(s, "$JS.API.STREAM.INFO.") && !strings.HasPrefix(s, "$JS.API.STREAM.MSG.GET.") {
				t.Errorf("reconciler of us-east may publish %s", s)
			}
			for _, verb := range []string{"STREAM.CREATE.", "STREAM.UPDATE."} {
				if strings.Contains(s, verb) && strings.Contains(s, other) {
					t.Errorf("reconciler of us-east may publish %s", s)
				}
			}
		}
	}
}

// TestReconcilerRelaysPartitionsOnly: a reconciler publishes its region's
// spends on the partitions' subjects alone, and each apply consumer it may
// make on its inbound stream reads one partition of one other region:
// ephemeral, under any name (a partition's reader is made again at each
// lease and each position it reads from), pulled, never acknowledged.
func TestReconcilerRelaysPartitionsOnly(t *testing.T) {
	p := natsauth.PermissionsFor(natsauth.RoleReconciler, "us-east", []string{"us-east", "eu-west", "ap-south"})
	if !slices.Contains(p.PublishAllow, "limiter.relay.us-east.*") {
		t.Error("reconciler of us-east may not publish its partitions' subjects")
	}
	if slices.Contains(p.PublishAllow, "limiter.relay.us-east") {
		t.Error("reconciler of us-east may publish limiter.relay.us-east, no partition's subject")
	}
	applies := regexp.MustCompile(`^\$JS\.API\.CONSUMER\.CREATE\.LIMITER_IN_US_EAST\.\*\.limiter\.relay\.(eu-west|ap-south)\.([0-9]+)$`)
	n := 0
	for _, s := range p.PublishAllow {
		if !strings.HasPrefix(s, "$JS.API.CONSUMER.CREATE.LIMITER_IN_US_EAST.") {
			continue
		}
		if applies.FindStringSubmatch(s) == nil {
			t.Errorf("reconciler of us-east may make %s, not one partition's apply consumer", s)
			continue
		}
		n++
	}
	if want := 2 * gossip.MaxPartitions; n != want {
		t.Errorf("reconciler of us-east may make %d apply consumers, want %d (2 regions x %d partitions)", n, want, gossip.MaxPartitions)
	}
	for _, s := range []string{"$JS.API.CONSUMER.MSG.NEXT.LIMITER_IN_US_EAST.*", "$JS.API.CONSUMER.INFO.LIMITER_IN_US_EAST.*"} {
		if !slices.Contains(p.PublishAllow, s) {
			t.Errorf("reconciler of us-east may not publish %s", s)
		}
	}
	for _, s := range p.PublishAllow {
		if strings.HasPrefix(s, "$JS.ACK.LIMITER_IN_US_EAST.") || strings.HasPrefix(s, "$JS.API.CONSUMER.CREATE.LIMITER_IN_US_EAST.apply-") {
			t.Errorf("reconciler of us-east may publish %s: its apply consumers are ephemeral and take no acks", s)
		}
	}
}

// TestReconcilerLeasesInItsBucket: a reconciler makes, reads and writes its
// own region's bucket of apply leases, and no other region's.
func TestReconcilerLeasesInItsBucket(t *testing.T) {
	p := natsauth.PermissionsFor(natsauth.RoleReconciler, "us-east", []string{"us-east", "eu-west", "ap-south"})
	for _, s := range []string{"$KV.LIMITER_APPLY_US_EAST.>", "$JS.API.STREAM.INFO.KV_LIMITER_APPLY_US_EAST", "$JS.API.STREAM.CREATE.KV_LIMITER_APPLY_US_EAST",
		"$JS.API.DIRECT.GET.KV_LIMITER_APPLY_US_EAST", "$JS.API.DIRECT.GET.KV_LIMITER_APPLY_US_EAST.>"} {
		if !slices.Contains(p.PublishAllow, s) {
			t.Errorf("reconciler of us-east may not publish %s", s)
		}
	}
	for _, s := range p.PublishAllow {
		if strings.Contains(s, "LIMITER_APPLY_") && !strings.Contains(s, "LIMITER_APPLY_US_EAST") {
			t.Errorf("reconciler of us-east may publish %s", s)
		}
	}
}

// TestWriteKeepsSeeds: writing the identities of one more region into the
// same directory keeps the seeds found there (the daemons running with
// them log in to a server reloaded with the new block) and makes seeds for
// the new region's identities only; Rotate makes new ones for all; a seed
// file that is not a user's seed is an error naming it.
func TestWriteKeepsSeeds(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "auth")
	before, err := natsauth.Write(dir, []string{"us-east", "eu-west"})
	if err != nil {
		t.Fatal(err)
	}
	keys := map[string]string{}
	for _, id := range before {
		if id.Kept {
			t.Errorf("%s kept in an empty directory", id.Name)
		}
		keys[id.Name] = id.PublicKey
	}
	after, err := natsauth.Write(dir, []string{"us-east", "eu-west", "ap-south"})
	if err != nil {
		t.Fatal(err)
	}
	if len(after) != 7 {
		t.Fatalf("%d identities, want 7", len(after))
	}
	for _, id := range after {
		old, had := keys[id.Name]
		if id.Kept != had || (had && id.PublicKey != old) {
			t.Errorf("%s: kept %v, key %s (before: %q)", id.Name, id.Kept, id.PublicKey, old)
		}
	}
	// The block written now admits the seeds written before.
	conf, err := os.ReadFile(filepath.Join(dir, natsauth.ConfigFile))
	if err != nil {
		t.Fatal(err)
	}
	srv := natstest.NewServer(t, natstest.Config(string(conf)))
	for _, name := range []string{"limiterd-us-east", "reconciler-ap-south", "admin"} {
		opt, err := nats.NkeyOptionFromSeed(natsauth.SeedFile(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		nc, err := nats.Connect(srv.URL(), opt)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		nc.Close()
	}
	rotated, err := natsauth.Write(dir, []string{"us-east", "eu-west", "ap-south"}, natsauth.Rotate())
	if err != nil {
		t.Fatal(err)
	}
	for i, id := range rotated {
		if id.Kept || id.PublicKey == after[i].PublicKey {
			t.Errorf("%s: not rotated", id.Name)
		}
	}
	// A file that is not a user's seed: not a seed, an account's seed.
	account, err := nkeys.CreateAccount()
	if err != nil {
		t.Fatal(err)
	}
	accountSeed, _ := account.Seed()
	bad := natsauth.SeedFile(dir, "limiterd-eu-west")
	for _, content := range []string{"not a seed\n", string(accountSeed) + "\n"} {
		if err := os.WriteFile(bad, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := natsauth.Write(dir, []string{"us-east", "eu-west"})
		t.Logf("%v", err)
		if err == nil || !strings.Contains(err.Error(), bad) {
			t.Errorf("a bad seed file %q: %v, want an error naming %s", strings.TrimSpace(content), err, bad)
		}
	}
}
