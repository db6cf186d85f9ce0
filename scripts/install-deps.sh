#!/usr/bin/env bash
# Installs what the integration tests need, from Debian packages, when it is
# missing: redis-server and redis-cli (packages redis-server, redis-tools),
# and nginx (package nginx, for deploy/nginx's test; it may be in /usr/sbin,
# which is not on every user's PATH). Called by `make deps` and `make test`.
# Prints one line saying what it did.
set -euo pipefail

have_nginx() { command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; }
nginx_bin() { command -v nginx 2>/dev/null || echo /usr/sbin/nginx; }
versions() {
	echo "redis $(redis-server --version | sed -n 's/.* v=\([^ ]*\).*/\1/p'), $("$(nginx_bin)" -v 2>&1 | sed -n 's/.*nginx\/\([^ ]*\).*/nginx \1/p')"
}

packages=""
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
	packages="redis-server redis-tools"
fi
if ! have_nginx; then
	packages="${packages:+$packages }nginx"
fi
install="apt-get update && apt-get install -y $packages"

if [ -z "$packages" ]; then
	echo "install-deps: redis-server, redis-cli and nginx already installed ($(versions)), nothing to do"
	exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
	echo "install-deps: missing $packages and apt-get is not available; install them yourself (Redis 7, nginx with auth_request; Debian/Ubuntu: $install)" >&2
	exit 1
fi

if [ "$(id -u)" -eq 0 ]; then
	sudo=""
elif command -v sudo >/dev/null 2>&1; then
	sudo="sudo"
else
	echo "install-deps: missing $packages and this is neither root nor has sudo; run as root: $install" >&2
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
if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1 || ! have_nginx; then
	echo "install-deps: apt-get installed $packages but redis-server, redis-cli or nginx is still not found (PATH $PATH, /usr/sbin/nginx)" >&2
	exit 1
fi
echo "install-deps: installed $packages with ${sudo:+$sudo }apt-get ($(versions))"
