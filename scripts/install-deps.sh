#!/usr/bin/env bash
# Installs what the integration tests need: redis-server and redis-cli, from
# the Debian packages redis-server and redis-tools, when either is missing.
# Called by `make deps` and `make test`. Prints one line saying what it did.
set -euo pipefail

packages="redis-server redis-tools"
install="apt-get update && apt-get install -y $packages"

if command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1; then
	echo "install-deps: redis-server and redis-cli already installed (redis $(redis-server --version | sed -n 's/.* v=\([^ ]*\).*/\1/p')), nothing to do"
	exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
	echo "install-deps: redis-server or redis-cli is missing and apt-get is not available; install Redis 7 yourself (Debian/Ubuntu: $install)" >&2
	exit 1
fi

if [ "$(id -u)" -eq 0 ]; then
	sudo=""
elif command -v sudo >/dev/null 2>&1; then
	sudo="sudo"
else
	echo "install-deps: redis-server or redis-cli is missing and this is neither root nor has sudo; run as root: $install" >&2
	exit 1
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
# shellcheck disable=SC2086 # $sudo and $packages are meant to split.
if ! { $sudo apt-get update -q && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $packages; } >"$log" 2>&1; then
	cat "$log" >&2
	echo "install-deps: failed: ${sudo:+$sudo }$install" >&2
	exit 1
fi
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
	echo "install-deps: apt-get installed $packages but redis-server or redis-cli is still not on PATH ($PATH)" >&2
	exit 1
fi
echo "install-deps: installed $packages with ${sudo:+$sudo }apt-get (redis $(redis-server --version | sed -n 's/.* v=\([^ ]*\).*/\1/p'))"
