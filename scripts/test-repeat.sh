#!/usr/bin/env bash
# Runs `go test -race -count=1` over the given packages N times in a row and
# counts the runs that failed: the check that the suite is deterministic.
# The output of each failed run is kept in a file named in the summary.
#
#   scripts/test-repeat.sh 20 ./internal/reconciler
#   scripts/test-repeat.sh 5 ./...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

runs=${1:?usage: test-repeat.sh RUNS PACKAGE...}
shift
[ $# -gt 0 ] || set -- ./internal/reconciler
GO=${GO:-go}
logs=$(mktemp -d "${TMPDIR:-/tmp}/test-repeat.XXXXXX")
failed=0
start=$SECONDS
for i in $(seq "$runs"); do
	t0=$SECONDS
	if "$GO" test -race -count=1 -timeout 20m "$@" >"$logs/run-$i.log" 2>&1; then
		echo "test-repeat: run $i/$runs ok ($((SECONDS - t0)) s)"
		rm -f "$logs/run-$i.log"
	else
		failed=$((failed + 1))
		echo "test-repeat: run $i/$runs FAILED ($((SECONDS - t0)) s), output in $logs/run-$i.log"
		grep -E '^(--- FAIL|FAIL|WARNING: DATA RACE|panic:)' "$logs/run-$i.log" | head -10 | sed 's/^/    /'
	fi
done
echo "test-repeat: $* x $runs in $((SECONDS - start)) s: $((runs - failed)) runs passed, $failed failed"
[ "$failed" -eq 0 ] && rmdir "$logs" 2>/dev/null
exit $((failed > 0))
