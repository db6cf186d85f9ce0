#!/usr/bin/env bash
# Lints the module: gofmt on every tracked .go file but the generated
# protobuf code, then golangci-lint with .golangci.yml (go vet's
# analyzers, staticcheck, errcheck, errorlint, misspell, godot, unused,
# ineffassign and the package map's import rules, depguard).
#
# golangci-lint is built at the version pinned below, with `go install`,
# into a folder every clone shares (~/.cache/limiterd/bin, or
# $LIMITER_TOOLS_DIR) when it is missing there, of another version or
# built by another Go; then reused (its own cache is
# ~/.cache/golangci-lint). Built into each clone, it cost every fresh
# clone a minute or two before the first test.
#
#   scripts/lint.sh [golangci-lint run's flags, e.g. --concurrency 1]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
GO=${GO:-go}
version=v2.15.0
tools=${LIMITER_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/limiterd/bin}
bin=$tools/golangci-lint

want="$version $("$GO" env GOVERSION)"
have=$("$GO" version -m "$bin" 2>/dev/null | awk 'NR == 1 { g = $2 } $1 == "mod" { v = $3 } END { print v, g }' || true)
if [ "$have" != "$want" ]; then
	echo "lint: building golangci-lint $version into $tools"
	mkdir -p "$tools"
	GOBIN=$tools "$GO" install "github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$version"
fi

# shellcheck disable=SC2046 # one argument per file.
out=$(gofmt -l $(git ls-files '*.go' | grep -v '\.pb\.go$'))
if [ -n "$out" ]; then
	echo "gofmt needed:"
	echo "$out"
	exit 1
fi
"$bin" run "$@" ./...
