package region

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestTestdata(t *testing.T) {
	files, err := filepath.Glob("testdata/*.yml")
	if err != nil || len(files) == 0 {
		t.Fatalf("no testdata: %v", err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			topo, err := Load(f)
			switch {
			case strings.HasSuffix(f, ".good.yml"):
				if err != nil {
					t.Fatalf("Load: %v", err)
				}
				if len(topo.Regions()) == 0 {
					t.Fatal("no regions loaded")
				}
			case strings.HasSuffix(f, ".bad.yml"):
				if !errors.Is(err, ErrInvalid) {
					t.Fatalf("Load = %v, want an error wrapping ErrInvalid", err)
				}
				if topo != nil {
					t.Fatal("Load returned a topology with an error")
				}
				if !strings.HasPrefix(err.Error(), f+": ") {
					t.Fatalf("error %q does not name the file", err)
				}
			default:
				t.Fatalf("testdata file %s is neither .good.yml nor .bad.yml", f)
			}
		})
	}
}

// Errors name the region and the field, so an operator can find the mistake.
func TestErrorsNameRegionAndField(t *testing.T) {
	tests := []struct {
		name string
		file string
		want string
	}{
		{"unknown field", "unknown-field.bad.yml", "field zone not found"},
		{"unknown top-level key", "unknown-top.bad.yml", "field region not found"},
		{"duplicate name", "duplicate-name.bad.yml", `regions[1] (name "us-east"): name: already used by regions[0]`},
		{"bad name", "bad-name.bad.yml", `regions[0] (name "US_East"): name: invalid region name`},
		{"leading dash", "leading-dash.bad.yml", `regions[0] (name "-east"): name:`},
		{"name too long", "long-name.bad.yml", `regions[0] (name "a1234`},
		{"missing name", "missing-name.bad.yml", `regions[0] (name ""): name:`},
		{"missing address", "missing-address.bad.yml", `regions[1] (name "eu-west"): limiter_address: missing`},
		{"no port", "no-port.bad.yml", `regions[0] (name "us-east"): limiter_address: "127.0.0.1" is not host:port`},
		{"port too large", "bad-port.bad.yml", `regions[0] (name "us-east"): limiter_address: port "65536"`},
		{"port zero", "zero-port.bad.yml", `limiter_address: port "0"`},
		{"named port", "named-port.bad.yml", `limiter_address: port "grpc"`},
		{"no host", "no-host.bad.yml", `limiter_address: ":8081" has no host`},
		{"empty file", "empty.bad.yml", "invalid topology: the file is empty"},
		{"comments only", "comments-only.bad.yml", "invalid topology: the file is empty"},
		{"no regions", "no-regions.bad.yml", "invalid topology: regions: no regions"},
		{"two documents", "two-documents.bad.yml", "more than one YAML document"},
		{"wrong type", "wrong-type.bad.yml", "cannot unmarshal"},
		{"negative generation", "negative-generation.bad.yml", `generation: "-1" is not a non-negative integer`},
		{"generation a word", "word-generation.bad.yml", `generation: "two" is not a non-negative integer`},
		{"generation a fraction", "fraction-generation.bad.yml", `generation: "1.5" is not a non-negative integer`},
		{"effective_at not a time", "bad-effective-at.bad.yml", `effective_at: "tomorrow" is not an RFC 3339 time`},
		{"effective_at without a zone", "no-zone-effective-at.bad.yml", `effective_at: "2026-05-01 12:00" is not an RFC 3339 time`},
		{"effective_at a list", "list-effective-at.bad.yml", `effective_at: not an RFC 3339 time`},
		{"previous_regions without effective_at", "previous-no-effective-at.bad.yml", `previous_regions: needs effective_at`},
		{"previous_regions twice", "previous-duplicate.bad.yml", `previous_regions[1] ("us-east"): already listed as previous_regions[0]`},
		{"previous_regions bad name", "previous-bad-name.bad.yml", `previous_regions[0]: invalid region name: "US"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join("testdata", tt.file)
			_, err := Load(path)
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("Load = %v, want an error wrapping ErrInvalid", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Load = %v, want it to contain %q", err, tt.want)
			}
		})
	}
}

func TestLoadMissingFile(t *testing.T) {
	_, err := Load(filepath.Join(t.TempDir(), "nope.yml"))
	if !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("Load = %v, want os.ErrNotExist", err)
	}
	if errors.Is(err, ErrInvalid) {
		t.Fatal("a missing file is not invalid content")
	}
}

func TestAccessors(t *testing.T) {
	topo, err := Load("testdata/example.good.yml")
	if err != nil {
		t.Fatal(err)
	}
	wantRegions := []Region{
		{Name: "us-east", LimiterAddress: "127.0.0.1:8081"},
		{Name: "eu-west", LimiterAddress: "127.0.0.1:8082"},
	}
	if got := topo.Regions(); !slices.Equal(got, wantRegions) {
		t.Fatalf("Regions = %v, want %v (file order)", got, wantRegions)
	}
	if got, want := topo.Names(), []string{"eu-west", "us-east"}; !slices.Equal(got, want) {
		t.Fatalf("Names = %v, want %v (sorted)", got, want)
	}
	tests := []struct {
		name   string
		region string
		want   Region
		ok     bool
	}{
		{"first", "us-east", wantRegions[0], true},
		{"second", "eu-west", wantRegions[1], true},
		{"unknown", "ap-south", Region{}, false},
		{"empty", "", Region{}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := topo.Region(tt.region)
			if got != tt.want || ok != tt.ok {
				t.Fatalf("Region(%q) = %v, %v; want %v, %v", tt.region, got, ok, tt.want, tt.ok)
			}
			if has := topo.Has(tt.region); has != tt.ok {
				t.Fatalf("Has(%q) = %v, want %v", tt.region, has, tt.ok)
			}
		})
	}

	// The topology is immutable: callers' slices are copies.
	topo.Regions()[0].Name = "changed"
	topo.Names()[0] = "changed"
	if topo.Regions()[0].Name != "us-east" || topo.Names()[0] != "eu-west" {
		t.Fatal("modifying a returned slice changed the topology")
	}
}

// A name YAML would read as an integer is still a name: "0" is valid.
func TestParseNumericName(t *testing.T) {
	topo, err := Load("testdata/ipv6.good.yml")
	if err != nil {
		t.Fatal(err)
	}
	if !topo.Has("0") || !topo.Has("ap-south-1") {
		t.Fatalf("Names = %v", topo.Names())
	}
}

func TestNew(t *testing.T) {
	ok := Region{Name: "us-east", LimiterAddress: "10.0.0.1:8081"}
	tests := []struct {
		name    string
		regions []Region
		want    string // "" means valid
	}{
		{"one region", []Region{ok}, ""},
		{"hostname", []Region{{Name: "eu-west", LimiterAddress: "limiter.eu-west.svc:443"}}, ""},
		{"ipv6", []Region{{Name: "eu-west", LimiterAddress: "[2001:db8::1]:443"}}, ""},
		{"nil", nil, "regions: no regions"},
		{"empty", []Region{}, "regions: no regions"},
		{"duplicate", []Region{ok, ok}, `regions[1] (name "us-east"): name: already used`},
		{"upper case", []Region{{Name: "Us", LimiterAddress: "h:1"}}, `regions[0] (name "Us"): name:`},
		{"dot", []Region{{Name: "us.east", LimiterAddress: "h:1"}}, `name:`},
		{"63 bytes", []Region{{Name: strings.Repeat("a", 63), LimiterAddress: "h:1"}}, ""},
		{"64 bytes", []Region{{Name: strings.Repeat("a", 64), LimiterAddress: "h:1"}}, "name:"},
		{"ipv6 unbracketed", []Region{{Name: "a", LimiterAddress: "::1:80"}}, "limiter_address:"},
		{"negative port", []Region{{Name: "a", LimiterAddress: "h:-1"}}, "limiter_address: port"},
		{"signed port", []Region{{Name: "a", LimiterAddress: "h:+80"}}, "limiter_address: port"},
		{"empty port", []Region{{Name: "a", LimiterAddress: "h:"}}, "limiter_address: port"},
		{"space in host", []Region{{Name: "a", LimiterAddress: " h:80"}}, "limiter_address: host"},
		{"url", []Region{{Name: "a", LimiterAddress: "http://h:80"}}, "limiter_address:"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			topo, err := New(tt.regions)
			if tt.want == "" {
				if err != nil {
					t.Fatalf("New: %v", err)
				}
				if !slices.Equal(topo.Regions(), tt.regions) {
					t.Fatalf("Regions = %v, want %v", topo.Regions(), tt.regions)
				}
				return
			}
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("New = %v, want an error wrapping ErrInvalid", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("New = %v, want it to contain %q", err, tt.want)
			}
		})
	}
}

func TestNewCopies(t *testing.T) {
	regions := []Region{{Name: "a", LimiterAddress: "h:1"}}
	topo, err := New(regions)
	if err != nil {
		t.Fatal(err)
	}
	regions[0].Name = "b"
	if !topo.Has("a") || topo.Regions()[0].Name != "a" {
		t.Fatal("New kept the caller's slice")
	}
}

// FuzzParse: any input either parses to a topology whose every region passes
// validation, or returns an error wrapping ErrInvalid; never a panic.
func FuzzParse(f *testing.F) {
	files, _ := filepath.Glob("testdata/*.yml")
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte("regions: [{name: a, limiter_address: 'h:1'}, {name: b, limiter_address: '[::1]:2'}]"))
	f.Add([]byte("regions:\n  - &r {name: a, limiter_address: 'h:1'}\n  - *r\n"))
	f.Add([]byte("regions: ~\n"))
	f.Add([]byte("---\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		topo, err := Parse("fuzz.yml", data)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error %v does not wrap ErrInvalid", err)
			}
			if topo != nil {
				t.Fatal("Parse returned a topology with an error")
			}
			if !strings.HasPrefix(err.Error(), "fuzz.yml: ") {
				t.Fatalf("error %q does not name the file", err)
			}
			return
		}
		regions := topo.Regions()
		if len(regions) == 0 {
			t.Fatal("a topology without regions was accepted")
		}
		for i, r := range regions {
			if err := r.validate(); err != nil {
				t.Fatalf("regions[%d] %+v accepted but invalid: %v", i, r, err)
			}
			if !topo.Has(r.Name) {
				t.Fatalf("Has(%q) = false", r.Name)
			}
		}
		if _, err := New(regions); err != nil {
			t.Fatalf("New rejects the regions Parse accepted: %v", err)
		}
		names := topo.Names()
		if len(names) != len(regions) || !slices.IsSorted(names) {
			t.Fatalf("Names = %v for %d regions", names, len(regions))
		}
		if h := topo.Home(string(data), nil); !topo.Has(h) {
			t.Fatalf("Home = %q, not a region of the topology", h)
		}
	})
}

// TestGenerationAndEffectiveAt: the header fields are read, and default to
// generation 0 and no instant.
func TestGenerationAndEffectiveAt(t *testing.T) {
	topo, err := Load("testdata/generation.good.yml")
	if err != nil {
		t.Fatal(err)
	}
	want := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	if topo.Generation() != 3 || !topo.EffectiveAt().Equal(want) {
		t.Fatalf("generation %d, effective_at %v; want 3, %v", topo.Generation(), topo.EffectiveAt(), want)
	}
	topo, err = Load("testdata/minimal.good.yml")
	if err != nil {
		t.Fatal(err)
	}
	if topo.Generation() != 0 || !topo.EffectiveAt().IsZero() {
		t.Fatalf("generation %d, effective_at %v; want 0 and none", topo.Generation(), topo.EffectiveAt())
	}
}

// TestCheckNext: a replacement may not lower the generation, and must raise
// it to change the regions or their addresses.
func TestCheckNext(t *testing.T) {
	parse := func(s string) *Topology {
		t.Helper()
		topo, err := Parse("t.yml", []byte(s))
		if err != nil {
			t.Fatal(err)
		}
		return topo
	}
	ab := "regions:\n  - {name: a, limiter_address: 'h:1'}\n  - {name: b, limiter_address: 'h:2'}\n"
	ba := "regions:\n  - {name: b, limiter_address: 'h:2'}\n  - {name: a, limiter_address: 'h:1'}\n"
	abc := ab + "  - {name: c, limiter_address: 'h:3'}\n"
	moved := "regions:\n  - {name: a, limiter_address: 'h:1'}\n  - {name: b, limiter_address: 'h:9'}\n"
	cur := parse("generation: 2\n" + ab)
	tests := []struct {
		name  string
		next  string
		want  error
		field string
	}{
		{"same file", "generation: 2\n" + ab, nil, ""},
		{"same regions in another order", "generation: 2\n" + ba, nil, ""},
		{"same regions, new effective_at", "generation: 2\neffective_at: 2026-01-01T00:00:00Z\n" + ab, nil, ""},
		{"same regions, higher generation", "generation: 3\n" + ab, nil, ""},
		{"region added, higher generation", "generation: 3\n" + abc, nil, ""},
		{"region added, same generation", "generation: 2\n" + abc, ErrGenerationNotRaised, "c added"},
		{"address changed, same generation", "generation: 2\n" + moved, ErrGenerationNotRaised, "b.limiter_address changed"},
		{"region removed, same generation", "generation: 2\nregions:\n  - {name: a, limiter_address: 'h:1'}\n", ErrGenerationNotRaised, "b removed"},
		{"lower generation", "generation: 1\n" + ab, ErrGenerationLower, "generation: 1 is lower than 2"},
		{"no generation", ab, ErrGenerationLower, "generation: 0 is lower than 2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := cur.CheckNext(parse(tt.next))
			if !errors.Is(err, tt.want) {
				t.Fatalf("CheckNext = %v, want %v", err, tt.want)
			}
			if err != nil && (!errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "generation: ") || !strings.Contains(err.Error(), tt.field)) {
				t.Fatalf("CheckNext = %v, want it to wrap ErrInvalid and name generation and %q", err, tt.field)
			}
		})
	}
}

// TestPrevious: previous_regions gives the homes keys had before the
// generation, as a topology of those regions would: a region added takes
// keys from the others only, a region removed gives its keys to them.
func TestPrevious(t *testing.T) {
	src := func(prev string, names ...string) string {
		s := "generation: 2\neffective_at: 2026-05-01T12:00:00Z\n"
		if prev != "" {
			s += "previous_regions: " + prev + "\n"
		}
		s += "regions:\n"
		for i, n := range names {
			s += fmt.Sprintf("  - name: %s\n    limiter_address: 10.0.0.%d:8081\n", n, i+1)
		}
		return s
	}
	parse := func(s string) *Topology {
		t.Helper()
		tp, err := Parse("t.yml", []byte(s))
		if err != nil {
			t.Fatal(err)
		}
		return tp
	}
	if p := parse(src("", "a", "b")).Previous(); p != nil {
		t.Fatalf("Previous without previous_regions = %v, want nil", p.Names())
	}
	added := parse(src("[a, b]", "a", "b", "c"))
	removed := parse(src("[c, b, a]", "a", "b"))
	ab, abc := parse(src("", "b", "a")), parse(src("", "a", "b", "c"))
	moved := 0
	for i := range 2000 {
		k := fmt.Sprintf("key-%d", i)
		if got, want := added.Previous().Home(k, nil), ab.Home(k, nil); got != want {
			t.Fatalf("%s: previous home %s, want %s (as {a, b} homes it)", k, got, want)
		}
		if got, want := removed.Previous().Home(k, nil), abc.Home(k, nil); got != want {
			t.Fatalf("%s: previous home %s, want %s (as {a, b, c} homes it)", k, got, want)
		}
		if added.Home(k, nil) != added.Previous().Home(k, nil) {
			moved++
			if added.Home(k, nil) != "c" {
				t.Fatalf("%s moved to %s, not to the region added", k, added.Home(k, nil))
			}
		}
	}
	if moved == 0 {
		t.Fatal("no key moved")
	}
	p := removed.Previous()
	if r, _ := p.Region("a"); r.LimiterAddress != "10.0.0.1:8081" {
		t.Errorf("previous region a has address %q, want this topology's", r.LimiterAddress)
	}
	if r, ok := p.Region("c"); !ok || r.LimiterAddress != "" {
		t.Errorf("previous region c (removed) = %+v, %v; want it with no address", r, ok)
	}
}
