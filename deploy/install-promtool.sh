#!/usr/bin/env bash
# Installs promtool into <repo>/bin, built from the same Prometheus module
# version that go.mod requires (so the rules are checked by the parser the
# deploy tests import). Does nothing when bin/promtool is already that
# version. Used by the deploy tests (`go test ./deploy/`), which look for
# promtool on PATH or in <repo>/bin. Prints one line saying what it did.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
go="${GO:-go}"
module=github.com/prometheus/prometheus
version="$("$go" list -m -f '{{.Version}}' "$module")"
bin="$root/bin/promtool"

if [ -x "$bin" ] && "$go" version -m "$bin" 2>/dev/null | grep -Eq "^[[:space:]]+mod[[:space:]]+$module[[:space:]]+$version([[:space:]]|$)"; then
	echo "install-promtool: $bin is already $module $version, nothing to do"
	exit 0
fi

start=$SECONDS
GOBIN="$root/bin" "$go" install "$module/cmd/promtool@$version"
echo "install-promtool: installed $bin ($module $version) in $((SECONDS - start))s"
