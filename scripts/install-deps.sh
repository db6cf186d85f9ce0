#!/usr/bin/env bash
# Installs, from Debian packages, what is missing of the tools named on the
# command line (all of them when none is named):
#
#   redis  redis-server and redis-cli (packages redis-server, redis-tools):
#          the integration tests and the local stack (make up)
#   nginx  nginx (package nginx), for deploy/nginx's test; it may be in
#          /usr/sbin, which is not on every user's PATH
#   cc     the C compiler go uses (`go env CC`, gcc by default; packages gcc,
#          libc6-dev): go test -race needs cgo, and without a C compiler go
#          turns cgo off
#   prometheus    prometheus (package prometheus, which brings a promtool
#                 too): the local stack's monitoring (make up MONITORING=1)
#                 and the alerts' end-to-end test
#   alertmanager  prometheus-alertmanager (package prometheus-alertmanager;
#                 upstream's alertmanager binary will do), for the same
#   redis-exporter  prometheus-redis-exporter (package
#                 prometheus-redis-exporter; upstream's redis_exporter binary
#                 will do): the local stack's monitoring scrapes every Redis
#                 node through it, and the dashboard's test reads its metrics
#   chromium      a headless Chromium (package chromium; chromium-browser
#                 or google-chrome will do): the status page's browser test
#
# `make test` and `make deps` install them all, `make up` only redis
# (with MONITORING=1, prometheus, alertmanager and redis-exporter too).
# Prints one line saying what it did.
set -euo pipefail

usage() { echo "usage: scripts/install-deps.sh [redis] [nginx] [cc] [prometheus] [alertmanager] [redis-exporter] [chromium]" >&2; }

want=("$@")
if [ ${#want[@]} -eq 0 ]; then want=(redis nginx cc prometheus alertmanager redis-exporter chromium); fi
for w in "${want[@]}"; do
	case $w in
	redis | nginx | cc | prometheus | alertmanager | redis-exporter | chromium) ;;
	*)
		usage
		exit 2
		;;
	esac
done

cc=$("${GO:-go}" env CC 2>/dev/null || true)
cc=${cc%% *} # CC may carry flags
cc=${cc:-gcc}

have() {
	case $1 in
	redis) command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 ;;
	nginx) command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] ;;
	cc) command -v "$cc" >/dev/null 2>&1 ;;
	prometheus) command -v prometheus >/dev/null 2>&1 ;;
	alertmanager) command -v prometheus-alertmanager >/dev/null 2>&1 || command -v alertmanager >/dev/null 2>&1 ;;
	redis-exporter) command -v prometheus-redis-exporter >/dev/null 2>&1 || command -v redis_exporter >/dev/null 2>&1 ;;
	chromium) command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || command -v google-chrome >/dev/null 2>&1 ;;
	esac
}
packages_of() {
	case $1 in
	redis) echo "redis-server redis-tools" ;;
	nginx) echo "nginx" ;;
	cc) echo "gcc libc6-dev" ;;
	prometheus) echo "prometheus" ;;
	alertmanager) echo "prometheus-alertmanager" ;;
	redis-exporter) echo "prometheus-redis-exporter" ;;
	chromium) echo "chromium" ;;
	esac
}
name_of() {
	case $1 in
	redis) echo "redis-server or redis-cli" ;;
	nginx) echo "nginx" ;;
	cc) echo "a C compiler ($cc)" ;;
	prometheus) echo "prometheus" ;;
	alertmanager) echo "alertmanager" ;;
	redis-exporter) echo "redis_exporter" ;;
	chromium) echo "chromium" ;;
	esac
}
version_of() {
	case $1 in
	redis) echo "redis $(redis-server --version | sed -n 's/.* v=\([^ ]*\).*/\1/p')" ;;
	nginx) "$(command -v nginx 2>/dev/null || echo /usr/sbin/nginx)" -v 2>&1 | sed -n 's/.*nginx\/\([^ ]*\).*/nginx \1/p' ;;
	cc) echo "$cc $("$cc" -dumpfullversion 2>/dev/null || "$cc" -dumpversion 2>/dev/null)" ;;
	prometheus) prometheus --version 2>&1 | sed -n '1s/^prometheus, version \([^ ]*\).*/prometheus \1/p' ;;
	alertmanager) "$(command -v prometheus-alertmanager 2>/dev/null || echo alertmanager)" --version 2>&1 | sed -n '1s/^alertmanager, version \([^ ]*\).*/alertmanager \1/p' ;;
	redis-exporter) "$(command -v prometheus-redis-exporter 2>/dev/null || echo redis_exporter)" --version 2>&1 | sed -n '1s/.*Redis Metrics Exporter v\{0,1\}\([0-9][0-9.]*\).*/redis_exporter \1/p' ;;
	chromium) "$(command -v chromium 2>/dev/null || command -v chromium-browser 2>/dev/null || echo google-chrome)" --version 2>/dev/null | sed -n 's/^\(Chromium\|Google Chrome\) \([0-9][0-9.]*\).*/chromium \2/p' ;;
	esac
}
# list WORDS...: "a", "a and b", "a, b and c".
list() {
	local out="" i
	for ((i = 1; i <= $#; i++)); do
		if ((i == 1)); then
			out=${!i}
		elif ((i == $#)); then
			out="$out and ${!i}"
		else
			out="$out, ${!i}"
		fi
	done
	echo "$out"
}
names() {
	local w ns=()
	for w in "${want[@]}"; do
		if [ "$w" = redis ]; then ns+=(redis-server redis-cli); else ns+=("$(name_of "$w")"); fi
	done
	list "${ns[@]}"
}
versions() {
	local w vs=()
	for w in "${want[@]}"; do vs+=("$(version_of "$w")"); done
	(IFS=,; echo "${vs[*]}") | sed 's/,/, /g'
}

packages=""
for w in "${want[@]}"; do
	if ! have "$w"; then packages="${packages:+$packages }$(packages_of "$w")"; fi
done
install="apt-get update && apt-get install -y $packages"

if [ -z "$packages" ]; then
	echo "install-deps: $(names) already installed ($(versions)), nothing to do"
	exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
	echo "install-deps: missing $packages and apt-get is not available; install them yourself (Redis 7, nginx with auth_request, a C compiler for go test -race, Prometheus 2, Alertmanager, redis_exporter and Chromium; Debian/Ubuntu: $install)" >&2
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
for w in "${want[@]}"; do
	if ! have "$w"; then
		echo "install-deps: apt-get installed $packages but $(name_of "$w") is still not found (PATH $PATH, /usr/sbin/nginx)" >&2
		exit 1
	fi
done
echo "install-deps: installed $packages with ${sudo:+$sudo }apt-get ($(versions))"
