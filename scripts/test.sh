#!/usr/bin/env bash
# Runs every package's tests with the race detector (but ./deploy's: see
# norace), in two phases, and a smoke run of the docs' benchmarks:
#
#  0. the lint (scripts/lint.sh) beside the compile of every test binary;
#  1. two streams side by side, one package at a time in each: one runs
#     internal/reconciler (whose tests mostly wait, on NATS gateways cut
#     for tens of seconds, on stream sources; they run four at a time,
#     on about 1.3 cores), then the long packages (the local stack's
#     bring-ups, the image build, the NATS clusters; about half a core),
#     then ./deploy; the other runs every other package but those of
#     phase 2 (about 0.6 cores), then internal/limiterd but its tests of
#     phase 2, then every `go test -bench` command the docs quote, once
#     (-benchtime 1x -short, two at a time; scripts/docbench_test.go, so
#     that a figure's command that no longer runs fails here). A third
#     stream, the reconciler's stacks beside the local stack's and the
#     rest, kept 2 cores at a load of 7-9: checks waited past their
#     deadlines in both stacks;
#  2. what is measured under its own load, one package at a time and
#     alone: the tests of internal/limiterd named in limiterd_alone
#     (exactly 10 of 50 client processes on busy cores, the model tests,
#     checks under store faults), those of internal/reconciler named in
#     reconciler_alone (the hold across the WAN, which beside phase 1
#     saw spends arrive after the key drained), the chaos soak, the scale model's smoke
#     run (real reconcilers, NATS and Redis under load, which beside phase
#     1 slowed its latency tests tenfold), the pacers, the stores' memory
#     bounds, and the Redis store (its TTL, expiry and breaker assertions
#     failed three times in four clean-clone runs beside phase 1).
#
# Each stream's output is printed when it ends; the script fails when any
# package failed.
#
#   LIMITER_NATS_SERVER=... scripts/test.sh   (LIMITER_TEST_LINT=0: no lint)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
GO=${GO:-go}
# -vet=off: the lint's govet runs a superset of the analyzers go test
# runs, which on a fresh machine would analyze every package again.
flags=(-race -count=1 -p 1 -timeout 20m -vet=off) # -race first: "${flags[@]:1}" drops it
# A binary built with -race sleeps 1 s when it exits, by default, so that
# other threads may finish a race report. Each test binary, and each
# daemon a test starts, would: about 45 s of phase 1's 74 packages, one at
# a time. A race is still reported, and fails its test, when it happens.
export GORACE=${GORACE:-atexit_sleep_ms=0}

alone=(./internal/soak ./internal/scale ./internal/engine ./pkg/bucket ./pkg/client ./internal/redisstore)
waiting=(./internal/reconciler)
# Phase 1's longest other packages, after internal/reconciler.
long=(./scripts ./internal/ociimage ./internal/testenv/natstest)
# Packages tested without the race detector: ./deploy renders the Helm
# chart and the kustomize overlays and reads the manifests, code of ours
# that runs no goroutines, through the Helm and Kubernetes modules (430
# packages no other test imports). Compiled with -race, they cost a fresh
# machine minutes. It runs last in the first stream.
norace=(./deploy)
# The tests of internal/limiterd whose guarantees are measured under their
# own load; its others run in phase 1. scripts/testsh_test.go checks that
# each is a test of the package.
limiterd_alone=(
	TestConcurrencyRace TestConcurrencyRaceProcesses TestRaceTwoInstances
	TestRaceSeparateProcessesBusyCores TestDenyCacheSparesTheStore
	TestRedisOutageUnderLoad TestFailoverUnderLoad TestPausedNodeUnderLoad
	TestFleetSharesTheFallback TestModelExactWithAHealthyStore
	TestModelBoundedUnderStoreFaults TestPacerProof
	TestPinnedConcurrencyAcrossRegions TestPinnedConcurrencyHomeDown
)
limiterd_re="^($(IFS='|'; echo "${limiterd_alone[*]}"))\$"
reconciler_alone=(TestHoldAcrossTheWAN)
reconciler_re="^($(IFS='|'; echo "${reconciler_alone[*]}"))\$"
mod=$("$GO" list -m)
others=()
for p in $("$GO" list ./...); do
	p=./${p#"$mod"/}
	[ "$p" = "./$mod" ] && p=.
	case " ${alone[*]} ${waiting[*]} ${long[*]} ${norace[*]} ./internal/limiterd " in *" $p "*) continue ;; esac
	others+=("$p")
done

logs=$(mktemp -d "${TMPDIR:-/tmp}/limiterd-test.XXXXXX")
pids=()
lint=
cleanup() {
	for pid in "${pids[@]}" $lint; do kill "$pid" 2>/dev/null || true; done
	rm -rf "$logs"
}
trap cleanup EXIT

failed=0
start=$SECONDS
# The lint (scripts/lint.sh: gofmt, golangci-lint, built when missing,
# minutes on a fresh machine) runs beside the compile, and ends before the
# tests start: beside phase 1 it slowed that phase by 300 s and made its
# latency tests fail. The compile is every package and test package,
# with the race detector, into the build cache, not linked (go list
# -export): compiled by phase 1 instead, the Kubernetes and Helm modules
# slowed its latency tests on a fresh machine; linked here too, each test
# binary was linked twice, 50 s more on a warm machine.
if [ "${LIMITER_TEST_LINT:-1}" != 0 ]; then
	GO=$GO scripts/lint.sh >"$logs/lint.log" 2>&1 &
	lint=$!
fi
"$GO" list -race -test -export -deps -f '{{.Export}}' "${alone[@]}" "${waiting[@]}" "${long[@]}" ./internal/limiterd "${others[@]}" >/dev/null
"$GO" list -test -export -deps -f '{{.Export}}' "${norace[@]}" >/dev/null
echo "test: packages compiled in $((SECONDS - start)) s"
if [ -n "$lint" ]; then
	rc=0
	wait "$lint" || rc=$?
	lint=
	cat "$logs/lint.log"
	if [ "$rc" -ne 0 ]; then
		echo "test: lint failed"
		failed=1
	fi
	echo "test: lint done at $((SECONDS - start)) s"
fi
start=$SECONDS
# timed NAME CMD... runs CMD and says, last in its stream's log, how long
# it took: where phase 1's time goes.
timed() {
	local name=$1 t0=$SECONDS rc=0
	shift
	"$@" || rc=$?
	echo "test: $name in $((SECONDS - t0)) s"
	return "$rc"
}
{
	rc=0
	timed "${waiting[*]}" "$GO" test "${flags[@]}" -parallel 4 -skip "$reconciler_re" "${waiting[@]}" || rc=1
	timed "${long[*]}" "$GO" test "${flags[@]}" "${long[@]}" || rc=1
	timed "${norace[*]} (no -race)" "$GO" test "${flags[@]:1}" "${norace[@]}" || rc=1
	exit "$rc"
} >"$logs/waiting.log" 2>&1 &
pids+=($!)
{
	rc=0
	timed "${#others[@]} other packages" "$GO" test "${flags[@]}" "${others[@]}" || rc=1
	timed "./internal/limiterd (phase 1)" "$GO" test "${flags[@]}" -skip "$limiterd_re" ./internal/limiterd || rc=1
	timed "the docs' benchmarks" "$GO" test -count=1 -timeout 20m -run '^TestDocBenchmarks$' ./scripts -args -docbench.run || rc=1
	exit "$rc"
} >"$logs/others.log" 2>&1 &
pids+=($!)
for i in 0 1; do
	rc=0
	wait "${pids[$i]}" || rc=$?
	[ "$rc" -eq 0 ] || failed=1
done
pids=()
cat "$logs/others.log" "$logs/waiting.log"
echo "test: phase 1 (${waiting[*]} ${long[*]} ${norace[*]} beside ${#others[@]} other packages, ./internal/limiterd but ${#limiterd_alone[@]} tests and the docs' benchmarks) in $((SECONDS - start)) s"
t1=$SECONDS
# The other packages first: what phase 1 started has ended by then (the
# pacers' proof, first, failed twice on a fresh clone right after it).
"$GO" test "${flags[@]}" "${alone[@]}" || failed=1
"$GO" test "${flags[@]}" -run "$limiterd_re" ./internal/limiterd || failed=1
"$GO" test "${flags[@]}" -run "$reconciler_re" ./internal/reconciler || failed=1
echo "test: phase 2 (${alone[*]}, ${#limiterd_alone[@]} tests of ./internal/limiterd, ${#reconciler_alone[@]} of ./internal/reconciler, alone) in $((SECONDS - t1)) s"
exit "$failed"
