#!/usr/bin/env bash
# The local three-region stack, on loopback: for each of us-east, eu-west and
# ap-south a 3-primary Redis Cluster, a reconciler, a limiterd and a NATS
# server with JetStream, the region's NATS cluster of one; gateways join the
# three into one supercluster (one JetStream domain), as in production.
# Every process it starts is recorded by pid under .stack/ and stopped by
# that pid only, never by name.
#
#   scripts/stack.sh up             # build, start, wait until healthy, print the addresses
#   scripts/stack.sh status         # what is running, and whether it answers
#   scripts/stack.sh down           # stop what `up` started and remove .stack/; safe to repeat
#   scripts/stack.sh admin-example  # the admin API calls `up` prints (README.md shows them)
#   scripts/stack.sh ports          # every address `up` listens on, "ADDR what" a line
#   scripts/stack.sh nats-auth DIR  # write the NATS identities `up` uses into DIR (for tests)
#   scripts/stack.sh stop NAME      # stop one component by its pid (NAME as `status` shows it:
#                                   # nats-us-east, reconciler-eu-west, limiterd-ap-south,
#                                   # redis-us-east:7001, prometheus, alertmanager, redis-exporter,
#                                   # nats-exporter)
#   scripts/stack.sh start NAME     # start it again as `up` did, and wait until it is healthy
#
# With MONITORING=1, `up` also starts a Prometheus scraping every limiterd and
# reconciler (target labels region, pod) with deploy/prometheus/alerts.yml, and
# an Alertmanager as its alerting target (Debian's prometheus and
# prometheus-alertmanager; scripts/install-deps.sh installs them). Prometheus
# also scrapes every Redis node (target label region) through one
# redis_exporter in multi-target mode (Debian's prometheus-redis-exporter,
# /scrape?target=redis://host:port), and every NATS server's monitoring
# endpoint through one natsexporter (internal/tools/natsexporter,
# /scrape?target=host:port).
#
# `up` writes a random bearer token for the limiterds' admin API into
# .stack/admin-token (mode 0600), and runs NATS locked: every daemon
# connects with its own nkey (.stack/nats/auth/<name>.nk, mode 0600) and may
# publish and subscribe only what internal/natsauth allows it; the limiterd
# of us-east also holds the admin writer's, the only identity that may
# write the rules bucket. A client without an nkey is refused.
#
# Regions are apart as real ones are: WAN sets the one-way delay of each
# pair, "a/b=DELAY" comma-separated (default
# us-east/eu-west=40ms,us-east/ap-south=110ms,eu-west/ap-south=75ms; a pair
# not named has none), one DELAY for every pair, or 0 for none (no proxy
# at all). A wanproxy process (internal/tools/wanproxy) then sits in front of
# each region's NATS gateway (the address every server advertises; a
# connection takes the delay of the region that dialed it) and of each
# Peer address one region's limiterd calls another's at (each region's
# daemons read a topology file of their own, .stack/topology-<region>.yml).
#
# Environment: GO (default go), RULES (default examples/rules.yml),
# STACK_TIMEOUT (seconds each component may take to become healthy, default 30),
# GOSSIP_INTERVAL (default 1s), LIMITERD_FLAGS (more flags for every limiterd,
# such as --redis.allow-unsafe-eviction), MONITORING (1: start Prometheus and
# Alertmanager too), MONITORING_RULES (the rules Prometheus loads, default
# deploy/prometheus/alerts.yml), MONITORING_INTERVAL (its scrape and evaluation
# interval, default 1s), WAN (above).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$PWD

GO=${GO:-go}
rules=${RULES:-examples/rules.yml}
timeout_s=${STACK_TIMEOUT:-30}
interval=${GOSSIP_INTERVAL:-1s}
read -r -a limiterd_flags <<<"${LIMITERD_FLAGS:-}"
case ${MONITORING:-} in 1 | true | yes) monitoring=1 ;; *) monitoring="" ;; esac
mon_rules=${MONITORING_RULES:-deploy/prometheus/alerts.yml}
mon_interval=${MONITORING_INTERVAL:-1s}
wan_default=us-east/eu-west=40ms,us-east/ap-south=110ms,eu-west/ap-south=75ms
wan_spec=${WAN:-$wan_default}
state=$root/.stack
pids_file=$state/pids # one line per process: name pid binary log
token_file=$state/admin-token
peer_secret_file=$state/peer-secret
auth_dir=$state/nats/auth
bin=$root/bin

regions=(us-east eu-west ap-south)
declare -A redis_ports=([us-east]="7000 7001 7002" [eu-west]="7100 7101 7102" [ap-south]="7200 7201 7202")
declare -A grpc_addr=([us-east]=127.0.0.1:8081 [eu-west]=127.0.0.1:8082 [ap-south]=127.0.0.1:8083)
declare -A http_addr=([us-east]=127.0.0.1:9091 [eu-west]=127.0.0.1:9092 [ap-south]=127.0.0.1:9093)
declare -A rec_addr=([us-east]=127.0.0.1:9191 [eu-west]=127.0.0.1:9192 [ap-south]=127.0.0.1:9193)
# Each region's nats-server: clients, monitoring, its cluster's routes and
# the gateway the other regions' servers dial.
declare -A nats_addr=([us-east]=127.0.0.1:4222 [eu-west]=127.0.0.1:4223 [ap-south]=127.0.0.1:4224)
declare -A nats_mon=([us-east]=127.0.0.1:8222 [eu-west]=127.0.0.1:8223 [ap-south]=127.0.0.1:8224)
declare -A nats_route=([us-east]=127.0.0.1:6222 [eu-west]=127.0.0.1:6223 [ap-south]=127.0.0.1:6224)
declare -A nats_gateway=([us-east]=127.0.0.1:7222 [eu-west]=127.0.0.1:7223 [ap-south]=127.0.0.1:7224)
# With WAN delays: the proxy in front of each region's gateway (what its
# server advertises and the others dial), and the one through which a
# region's limiterd reaches another's, "from/to" (port 18000 + 100 x the
# index of from + 81 + the index of to), and the proxy's health address.
declare -A gateway_proxy=([us-east]=127.0.0.1:17222 [eu-west]=127.0.0.1:17223 [ap-south]=127.0.0.1:17224)
declare -A peer_proxy=()
declare -A wan_delay=()
wan_http=127.0.0.1:9290
# Each spend stream's bound (--stream.max-bytes): a region's four streams
# share its server's JetStream store.
stream_max_mib=64
# MONITORING=1: Prometheus and Alertmanager (its cluster listener off), and
# the exporters Prometheus reads every Redis node and NATS server through.
prom_addr=127.0.0.1:9090
am_addr=127.0.0.1:9094
redis_exporter_addr=127.0.0.1:9095
nats_exporter_addr=127.0.0.1:9096
cmd_dir=$state/cmd # one file per process: the command line `start NAME` runs again

log() { echo "stack: $*"; }
err() { echo "stack: $*" >&2; }

# parse_wan: fill wan_delay["a/b"] (both orders) from WAN, and peer_proxy;
# wan_on says whether there is a proxy at all.
wan_on=""
is_delay() { [[ $1 =~ ^(0|[0-9]+(\.[0-9]+)?(us|ms|s))$ ]]; }
parse_wan() {
	local item pair d a b i j known
	case $wan_spec in 0 | off | none) return 0 ;; esac
	wan_on=1
	for a in "${regions[@]}"; do
		for b in "${regions[@]}"; do [ "$a" = "$b" ] || wan_delay[$a/$b]=0; done
	done
	if [[ $wan_spec != *=* ]]; then
		if ! is_delay "$wan_spec"; then
			err "WAN: $wan_spec: want 0, a delay such as 40ms, or REGION/REGION=DELAY,..."
			return 1
		fi
		for pair in "${!wan_delay[@]}"; do wan_delay[$pair]=$wan_spec; done
	else
		IFS=, read -r -a items <<<"$wan_spec"
		for item in "${items[@]}"; do
			pair=${item%%=*} d=${item#*=}
			a=${pair%%/*} b=${pair#*/}
			known=""
			[ -n "${wan_delay[$a/$b]+x}" ] && known=1
			if [[ $item != */*=* ]] || [ -z "$known" ] || ! is_delay "$d"; then
				err "WAN: $item: want REGION/REGION=DELAY with two of ${regions[*]}"
				return 1
			fi
			wan_delay[$a/$b]=$d wan_delay[$b/$a]=$d
		done
	fi
	for i in "${!regions[@]}"; do
		for j in "${!regions[@]}"; do
			[ "$i" = "$j" ] || peer_proxy[${regions[$i]}/${regions[$j]}]=127.0.0.1:$((18000 + 100 * i + 81 + j))
		done
	done
}
parse_wan || exit 2

# wan_summary: the delays, "a/b DELAY" for each pair once.
wan_summary() {
	local i j out=()
	for i in "${!regions[@]}"; do
		for ((j = i + 1; j < ${#regions[@]}; j++)); do
			out+=("${regions[$i]}/${regions[$j]} ${wan_delay[${regions[$i]}/${regions[$j]}]}")
		done
	done
	local IFS=,
	echo "${out[*]}"
}

# wan_args: the wanproxy command's routes, a word a line: each region's
# gateway, by dialing cluster, and each Peer link.
wan_args() {
	local r o args
	for r in "${regions[@]}"; do
		args="${gateway_proxy[$r]}=${nats_gateway[$r]}"
		for o in "${regions[@]}"; do [ "$o" = "$r" ] || args+=",$o:${wan_delay[$o/$r]}"; done
		printf '%s\n' --nats-gateway "$args"
		for o in "${regions[@]}"; do
			[ "$o" = "$r" ] || printf '%s\n' --tcp "${peer_proxy[$r/$o]}=${grpc_addr[$o]},${wan_delay[$r/$o]}"
		done
	done
}

# topology REGION: the topology file REGION's daemons read: with WAN
# delays the other regions' limiterd at their Peer proxies.
topology() {
	local r=$1 o
	echo "# Generated by scripts/stack.sh: the three local regions${wan_on:+, as $r reaches them}."
	echo "regions:"
	for o in "${regions[@]}"; do
		echo "  - name: $o"
		if [ -n "$wan_on" ] && [ -n "$r" ] && [ "$o" != "$r" ]; then
			echo "    limiter_address: ${peer_proxy[$r/$o]}"
		else
			echo "    limiter_address: ${grpc_addr[$o]}"
		fi
	done
}

# topology_file REGION: where REGION's daemons read their topology.
topology_file() {
	if [ -n "$wan_on" ]; then echo "$state/topology-$1.yml"; else echo "$state/topology.yml"; fi
}

# admin_example: ready-to-paste calls of us-east's admin API, from the repo
# root: put a rule, then read it back. README.md holds the same lines.
admin_example() {
	local auth='-H "Authorization: Bearer $(cat .stack/admin-token)"'
	echo "curl -X PUT $auth --data-binary \\"
	echo "  \$'id: burst\\ncapacity: 5\\nrefill_per_second: 1\\n' ${http_addr[us-east]}/admin/rules/burst"
	echo "curl $auth ${http_addr[us-east]}/admin/rules/burst"
}

# nats_auth DIR COMMAND...: write the identities of the regions into DIR
# with the natsauth command given: auth.conf (the authorization block
# nats.conf includes) and one seed per identity.
nats_auth() {
	local dir=$1 list
	shift
	list=$(IFS=,; echo "${regions[*]}")
	"$@" --regions "$list" --dir "$dir" >/dev/null
}

# in_use ADDR: something accepts connections on ADDR (host:port).
in_use() { (exec 3<>"/dev/tcp/${1%:*}/${1##*:}") 2>/dev/null; }

# http_ok ADDR PATH: GET http://ADDR/PATH answers 200 within 2 s. Plain bash,
# so a machine with only Go needs no curl.
http_ok() {
	timeout 2 bash -c '
		exec 3<>"/dev/tcp/${0%:*}/${0##*:}" || exit 1
		printf "GET %s HTTP/1.0\r\nHost: %s\r\n\r\n" "$1" "$0" >&3
		IFS= read -r status <&3 || exit 1
		case $status in "HTTP/1."?" 200 "*) exit 0 ;; esac
		exit 1' "$1" "$2" 2>/dev/null
}

# http_get ADDR PATH: the body of GET http://ADDR/PATH, within 2 s.
http_get() {
	timeout 2 bash -c '
		exec 3<>"/dev/tcp/${0%:*}/${0##*:}" || exit 1
		printf "GET %s HTTP/1.0\r\nHost: %s\r\n\r\n" "$1" "$0" >&3
		cat <&3' "$1" "$2" 2>/dev/null
}

# alive PID BINARY: PID is running and is BINARY (not a recycled pid).
alive() {
	local exe
	kill -0 "$1" 2>/dev/null || return 1
	exe=$(readlink "/proc/$1/exe" 2>/dev/null) || return 1
	[ "${exe% (deleted)}" = "$2" ]
}

# started PID: PID, which this script just started, has not exited. Its
# executable may still be nohup's for a moment, so alive does not fit yet.
started() { kill -0 "$1" 2>/dev/null && ! grep -qs '^State:[[:space:]]*Z' "/proc/$1/status"; }

tail_log() {
	echo "---- last lines of $1 ----" >&2
	tail -n 30 "$1" >&2 2>/dev/null || echo "(no log)" >&2
	echo "----" >&2
}

every_port() {
	local r p
	for r in "${regions[@]}"; do
		for p in ${redis_ports[$r]}; do
			echo "127.0.0.1:$p redis-$r"
			echo "127.0.0.1:$((p + 10000)) redis-$r-cluster-bus"
		done
		echo "${grpc_addr[$r]} limiterd-$r-grpc"
		echo "${http_addr[$r]} limiterd-$r-http"
		echo "${rec_addr[$r]} reconciler-$r-http"
		echo "${nats_addr[$r]} nats-$r"
		echo "${nats_mon[$r]} nats-$r-monitoring"
		echo "${nats_route[$r]} nats-$r-cluster"
		echo "${nats_gateway[$r]} nats-$r-gateway"
		if [ -n "$wan_on" ]; then
			echo "${gateway_proxy[$r]} wanproxy-nats-$r-gateway"
			for o in "${regions[@]}"; do [ "$o" = "$r" ] || echo "${peer_proxy[$r/$o]} wanproxy-peer-$r-to-$o"; done
		fi
	done
	if [ -n "$wan_on" ]; then echo "$wan_http wanproxy-http"; fi
	if [ -n "$monitoring" ]; then
		echo "$prom_addr prometheus"
		echo "$am_addr alertmanager"
		echo "$redis_exporter_addr redis-exporter"
		echo "$nats_exporter_addr nats-exporter"
	fi
}

# nats_conf REGION: the configuration of REGION's nats-server: a cluster
# of one (the route to itself, which the server ignores, is what clustered
# JetStream asks for) named after the region, and a gateway of the same
# name to every other region's.
nats_conf() {
	local r=$1 o
	cat <<-EOF
		# Generated by scripts/stack.sh: the NATS cluster of $r.
		server_name: nats-$r
		listen: ${nats_addr[$r]}
		http: ${nats_mon[$r]}
		jetstream {
		  store_dir: "$state/nats/$r/jetstream"
		  max_memory_store: 64MB
		  max_file_store: $((4 * stream_max_mib + 256))MB
		}
		cluster {
		  name: "$r"
		  listen: ${nats_route[$r]}
		  routes: ["nats-route://${nats_route[$r]}"]
		}
		gateway {
		  name: "$r"
		  listen: ${nats_gateway[$r]}
	EOF
	# Behind the WAN proxy, the server advertises the proxy's address, so
	# that the others learn no way around it.
	if [ -n "$wan_on" ]; then echo "  advertise: ${gateway_proxy[$r]}"; fi
	echo "  gateways: ["
	for o in "${regions[@]}"; do
		if [ "$o" = "$r" ]; then continue; fi
		if [ -n "$wan_on" ]; then
			echo "    { name: \"$o\", urls: [\"nats://${gateway_proxy[$o]}\"] }"
		else
			echo "    { name: \"$o\", urls: [\"nats://${nats_gateway[$o]}\"] }"
		fi
	done
	cat <<-EOF
		  ]
		}
		include "../auth/auth.conf"
	EOF
}

# running: the recorded processes that are still alive, one "name pid" a line.
running() {
	local name pid binary logf r p
	if [ -f "$pids_file" ]; then
		while read -r name pid binary logf; do
			if alive "$pid" "$binary"; then echo "$name $pid"; fi
		done <"$pids_file"
	fi
	for r in "${regions[@]}"; do
		for p in ${redis_ports[$r]}; do
			pid=$(cat "$state/redis/$r/$p/redis.pid" 2>/dev/null) || continue
			if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = redis-server ]; then echo "redis-$r:$p $pid"; fi
		done
	done
}

# stop_all: stop the recorded processes, newest first (limiterd flushes its
# spends before the reconcilers and NATS go), then the Redis nodes.
stop_all() {
	local name pid binary logf lines i r pidfile
	if [ -f "$pids_file" ]; then
		mapfile -t lines <"$pids_file"
		for ((i = ${#lines[@]} - 1; i >= 0; i--)); do
			read -r name pid binary logf <<<"${lines[$i]}"
			if alive "$pid" "$binary"; then
				kill "$pid" 2>/dev/null || true
				for _ in $(seq 100); do alive "$pid" "$binary" || break; sleep 0.1; done
				if alive "$pid" "$binary"; then
					err "$name (pid $pid) still running 10 s after SIGTERM: sending SIGKILL"
					kill -9 "$pid" 2>/dev/null || true
				fi
				log "stopped $name (pid $pid)"
			fi
		done
		rm -f "$pids_file"
	fi
	for r in "${regions[@]}"; do
		# redis-cluster.sh stops by pid file: drop a file whose pid is no
		# longer a redis-server, so that a reused pid is never signalled.
		for pidfile in "$state/redis/$r"/*/redis.pid; do
			[ -f "$pidfile" ] || continue
			pid=$(cat "$pidfile")
			[ "$(cat "/proc/$pid/comm" 2>/dev/null)" = redis-server ] || rm -f "$pidfile"
		done
		if compgen -G "$state/redis/$r/*/redis.pid" >/dev/null; then
			scripts/redis-cluster.sh stop "$state/redis/$r"
			log "stopped redis-$r (127.0.0.1:${redis_ports[$r]// /,})"
		fi
	done
}

# start NAME LOG BINARY ARGS...: start a process in the background, record it.
start() {
	local name=$1 logf=$2 binary=$3
	shift 3
	nohup "$binary" "$@" </dev/null >"$logf" 2>&1 &
	echo "$name $! $binary $logf" >>"$pids_file"
	mkdir -p "$cmd_dir"
	printf '%q ' "$logf" "$binary" "$@" >"$cmd_dir/$name"
}

# wait_healthy NAME ADDR PATH: wait until GET ADDR/PATH answers 200, or fail
# with the log tail when the process exits or the timeout passes.
wait_healthy() {
	local name=$1 addr=$2 path=$3 pid binary logf deadline
	read -r _ pid binary logf < <(grep "^$name " "$pids_file")
	deadline=$((SECONDS + timeout_s))
	until http_ok "$addr" "$path"; do
		if ! started "$pid"; then
			err "$name exited before it was healthy (log $logf)"
			tail_log "$logf"
			return 1
		fi
		if ((SECONDS >= deadline)); then
			err "$name not healthy after ${timeout_s}s: http://$addr$path does not answer 200 (log $logf)"
			tail_log "$logf"
			return 1
		fi
		sleep 0.2
	done
	log "$name healthy (http://$addr$path)"
}

# wait_gateways REGION: wait until REGION's nats-server has an outbound
# gateway to every other region (its /gatewayz names them).
wait_gateways() {
	local r=$1 o deadline body
	deadline=$((SECONDS + timeout_s))
	for o in "${regions[@]}"; do
		[ "$o" != "$r" ] || continue
		until body=$(http_get "${nats_mon[$r]}" /gatewayz) && grep -q "\"$o\": *{" <<<"${body#*outbound_gateways}"; do
			if ((SECONDS >= deadline)); then
				err "nats-$r has no gateway to $o after ${timeout_s}s (log $state/logs/nats-$r.log)"
				tail_log "$state/logs/nats-$r.log"
				return 1
			fi
			sleep 0.2
		done
	done
	log "nats-$r: gateways to every other region"
}

# wait_sources SINCE REGION: wait until REGION's inbound stream hears of
# every other region's spends stream: limiter_stream_source_active_seconds
# under 2 s for each, read 3 s or more after SINCE (a source never heard of
# counts its quiet from the reconciler's first look, so it is under 2 s
# too at first). Spends flow then, not only are the streams made: a source
# made before the stream it reads may wait on the server's back-off until
# the reconciler resets it, some seconds later.
wait_sources() {
	local since=$1 r=$2 o deadline body quiet
	deadline=$((SECONDS + timeout_s))
	for o in "${regions[@]}"; do
		[ "$o" != "$r" ] || continue
		until body=$(http_get "${rec_addr[$r]}" /metrics) &&
			quiet=$(awk -v src="source_region=\"$o\"" 'index($0, "limiter_stream_source_active_seconds{") == 1 && index($0, src) { print $2 }' <<<"$body") &&
			[ -n "$quiet" ] && awk -v q="$quiet" 'BEGIN { exit !(q < 2) }' && ((SECONDS - since >= 3)); do
			if ((SECONDS >= deadline)); then
				err "reconciler-$r has not heard of $o's spends stream after ${timeout_s}s (log $state/logs/reconciler-$r.log)"
				tail_log "$state/logs/reconciler-$r.log"
				return 1
			fi
			sleep 0.2
		done
	done
	log "reconciler-$r: spends flowing in from every other region"
}

# monitoring_bins: the prometheus, alertmanager and redis_exporter binaries
# (Debian names them prometheus-alertmanager and prometheus-redis-exporter),
# resolved as /proc/PID/exe shows them, or a message saying what installs
# them.
monitoring_bins() {
	local a x
	prom_bin=$(command -v prometheus 2>/dev/null) ||
		{ err "MONITORING=1: prometheus missing: run scripts/install-deps.sh prometheus alertmanager redis-exporter"; return 1; }
	a=$(command -v prometheus-alertmanager 2>/dev/null || command -v alertmanager 2>/dev/null) ||
		{ err "MONITORING=1: alertmanager (prometheus-alertmanager) missing: run scripts/install-deps.sh prometheus alertmanager redis-exporter"; return 1; }
	x=$(command -v prometheus-redis-exporter 2>/dev/null || command -v redis_exporter 2>/dev/null) ||
		{ err "MONITORING=1: redis_exporter (prometheus-redis-exporter) missing: run scripts/install-deps.sh prometheus alertmanager redis-exporter"; return 1; }
	prom_bin=$(readlink -f "$prom_bin")
	am_bin=$(readlink -f "$a")
	redis_exporter_bin=$(readlink -f "$x")
}

# exporter_job NAME EXPORTER TARGET_OF: a scrape job of a multi-target
# exporter at EXPORTER: one target per node of every region (TARGET_OF
# REGION prints them, a line each), labelled with the region; Prometheus
# asks the exporter for /scrape?target=NODE, and the node is the series'
# instance.
exporter_job() {
	local name=$1 exporter=$2 target_of=$3 r t
	echo "  - job_name: $name"
	echo "    metrics_path: /scrape"
	echo "    static_configs:"
	for r in "${regions[@]}"; do
		echo "      - targets:"
		while read -r t; do echo "          - \"$t\""; done < <("$target_of" "$r")
		echo "        labels: {region: $r}"
	done
	cat <<-EOF
		    relabel_configs:
		      - source_labels: [__address__]
		        target_label: __param_target
		      - source_labels: [__param_target]
		        target_label: instance
		      - target_label: __address__
		        replacement: "$exporter"
	EOF
}

# redis_targets REGION: redis_exporter's target of each Redis node of REGION.
redis_targets() {
	local p
	for p in ${redis_ports[$1]}; do echo "redis://127.0.0.1:$p"; done
}

# nats_targets REGION: natsexporter's target of REGION's NATS server: its
# monitoring address.
nats_targets() { echo "${nats_mon[$1]}"; }

# prometheus_conf: MONITORING_RULES by its path (POST /-/reload reads it
# again), every limiterd and reconciler of every region, labelled
# with the region and the pod as in Kubernetes (the alerts group by them),
# every Redis node through redis_exporter, every NATS server through
# natsexporter, the rules of MONITORING_RULES and the Alertmanager.
prometheus_conf() {
	local r job addr rules_abs
	rules_abs=$(readlink -f "$mon_rules")
	cat <<-EOF
		# Generated by scripts/stack.sh: the local stack's Prometheus.
		global:
		  scrape_interval: $mon_interval
		  scrape_timeout: $mon_interval
		  evaluation_interval: $mon_interval
		rule_files:
		  - "$rules_abs"
		alerting:
		  alertmanagers:
		    - static_configs:
		        - targets: ["$am_addr"]
		scrape_configs:
	EOF
	for job in limiterd reconciler; do
		echo "  - job_name: $job"
		echo "    static_configs:"
		for r in "${regions[@]}"; do
			if [ $job = limiterd ]; then addr=${http_addr[$r]}; else addr=${rec_addr[$r]}; fi
			echo "      - targets: [\"$addr\"]"
			echo "        labels: {region: $r, pod: $job-$r}"
		done
	done
	exporter_job redis "$redis_exporter_addr" redis_targets
	exporter_job nats "$nats_exporter_addr" nats_targets
	cat <<-EOF
		  - job_name: prometheus
		    static_configs:
		      - targets: ["$prom_addr"]
		  - job_name: alertmanager
		    static_configs:
		      - targets: ["$am_addr"]
	EOF
}

# alertmanager_conf: one receiver that sends nothing: the alerts are seen
# in Alertmanager's UI and API.
alertmanager_conf() {
	cat <<-EOF
		# Generated by scripts/stack.sh: the local stack's Alertmanager.
		route:
		  receiver: stack
		  group_by: [alertname, region]
		  group_wait: 1s
		  group_interval: 10s
		  repeat_interval: 1h
		receivers:
		  - name: stack
	EOF
}

start_monitoring() {
	mkdir -p "$state/prometheus/data" "$state/alertmanager/data"
	prometheus_conf >"$state/prometheus/prometheus.yml"
	alertmanager_conf >"$state/alertmanager/alertmanager.yml"
	# No --redis.addr: /metrics has the exporter's own series, and every
	# node is read at /scrape?target=.
	start redis-exporter "$state/logs/redis-exporter.log" "$redis_exporter_bin" \
		-web.listen-address "$redis_exporter_addr" -redis.addr ""
	wait_healthy redis-exporter "$redis_exporter_addr" /health
	local r targets=()
	for r in "${regions[@]}"; do targets+=("${nats_mon[$r]}"); done
	start nats-exporter "$state/logs/nats-exporter.log" "$bin/natsexporter" \
		--listen "$nats_exporter_addr" --targets "$(IFS=,; echo "${targets[*]}")"
	wait_healthy nats-exporter "$nats_exporter_addr" /metrics
	start alertmanager "$state/logs/alertmanager.log" "$am_bin" \
		--config.file "$state/alertmanager/alertmanager.yml" --storage.path "$state/alertmanager/data" \
		--web.listen-address "$am_addr" --cluster.listen-address ""
	wait_healthy alertmanager "$am_addr" /-/ready
	start prometheus "$state/logs/prometheus.log" "$prom_bin" \
		--config.file "$state/prometheus/prometheus.yml" --storage.tsdb.path "$state/prometheus/data" \
		--storage.tsdb.retention.time 1d --web.listen-address "$prom_addr" --web.enable-lifecycle
	wait_healthy prometheus "$prom_addr" /-/ready
}

up() {
	local r busy=() addr what p
	if [ -n "$(running)" ]; then
		err "the stack is already up (state in $state); run 'make down' first"
		running | sed 's/^/  /' >&2
		exit 1
	fi
	while read -r addr what; do
		if in_use "$addr"; then busy+=("$addr ($what)"); fi
	done < <(every_port)
	if [ ${#busy[@]} -gt 0 ]; then
		err "refusing to start: these ports are already in use:"
		printf '  %s\n' "${busy[@]}" >&2
		exit 1
	fi
	[ -f "$rules" ] || { err "rules file $rules not found"; exit 1; }
	command -v redis-server >/dev/null && command -v redis-cli >/dev/null ||
		{ err "redis-server or redis-cli missing: run scripts/install-deps.sh"; exit 1; }
	if [ -n "$monitoring" ]; then
		monitoring_bins || exit 1
		[ -f "$mon_rules" ] || { err "MONITORING_RULES file $mon_rules not found"; exit 1; }
	fi

	local tools=(./cmd/limiterd ./cmd/reconciler ./internal/tools/natsauth ./internal/tools/wanproxy)
	if [ -n "$monitoring" ]; then tools+=(./internal/tools/natsexporter); fi
	log "building bin/limiterd, bin/reconciler, bin/natsauth, bin/wanproxy${monitoring:+, bin/natsexporter} and bin/nats-server"
	"$GO" build -o "$bin/" "${tools[@]}"
	"$GO" build -o "$bin/nats-server" github.com/nats-io/nats-server/v2

	rm -rf "$state"
	mkdir -p "$state/logs" "$state/redis"
	for r in "${regions[@]}"; do mkdir -p "$state/nats/$r/jetstream"; done
	: >"$pids_file"
	# 32 random bytes in hex: the admin API wants at least 16 characters.
	(umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$token_file")
	# The secret the regions share for checks of pinned rules forwarded to
	# a key's home region (limiter.v1.Peer refuses any call without it).
	(umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$peer_secret_file")
	# From here on, a failure stops whatever was started; the logs stay.
	trap 'rc=$?; if [ $rc -ne 0 ]; then err "start-up failed: stopping what was started; logs kept in $state/logs"; stop_all; fi' EXIT
	trap 'exit 130' INT TERM

	topology "" >"$state/topology.yml"
	if [ -n "$wan_on" ]; then
		for r in "${regions[@]}"; do topology "$r" >"$(topology_file "$r")"; done
	fi

	for r in "${regions[@]}"; do
		# shellcheck disable=SC2086 # the ports are meant to split.
		if ! scripts/redis-cluster.sh start "$state/redis/$r" ${redis_ports[$r]} >"$state/logs/redis-$r.log" 2>&1; then
			err "the Redis Cluster of $r did not start"
			tail_log "$state/logs/redis-$r.log"
			for p in ${redis_ports[$r]}; do tail_log "$state/redis/$r/$p/redis.log"; done
			exit 1
		fi
		log "redis-$r: cluster ok on 127.0.0.1:${redis_ports[$r]// /,}"
	done

	# JetStream limits: the defaults are most of the disk and a share of
	# memory. A region's four streams (local, spends, inbound, retry) of at
	# most --stream.max-bytes each, and the rules bucket, fit in its
	# server's max_file_store.
	# auth/auth.conf: the identities and their permissions (natsauth),
	# the same on every server.
	nats_auth "$auth_dir" "$bin/natsauth"
	if [ -n "$wan_on" ]; then
		local wargs
		mapfile -t wargs < <(wan_args)
		start wanproxy "$state/logs/wanproxy.log" "$bin/wanproxy" --http.listen-address "$wan_http" "${wargs[@]}"
		wait_healthy wanproxy "$wan_http" /healthz
	fi
	for r in "${regions[@]}"; do
		nats_conf "$r" >"$state/nats/$r/nats.conf"
		start "nats-$r" "$state/logs/nats-$r.log" "$bin/nats-server" -c "$state/nats/$r/nats.conf"
	done
	for r in "${regions[@]}"; do wait_healthy "nats-$r" "${nats_mon[$r]}" "/healthz?js-enabled-only=true"; done
	# The supercluster is formed once every server has a JetStream meta
	# leader (a full /healthz) and its gateways to the others.
	for r in "${regions[@]}"; do wait_healthy "nats-$r" "${nats_mon[$r]}" /healthz; done
	for r in "${regions[@]}"; do wait_gateways "$r"; done

	local redis_addrs
	for r in "${regions[@]}"; do
		redis_addrs=$(printf '127.0.0.1:%s,' ${redis_ports[$r]})
		redis_addrs=${redis_addrs%,}
		start "reconciler-$r" "$state/logs/reconciler-$r.log" "$bin/reconciler" \
			--region "$r" --region.topology-file "$(topology_file "$r")" --rules.file "$rules" \
			--nats.url "nats://${nats_addr[$r]}" --nats.nkey-seed-file "$auth_dir/reconciler-$r.nk" --redis.addrs "$redis_addrs" \
			--http.listen-address "${rec_addr[$r]}" --gossip.interval "$interval" \
			--stream.max-bytes $((stream_max_mib << 20))
	done
	for r in "${regions[@]}"; do wait_healthy "reconciler-$r" "${rec_addr[$r]}" /readyz; done
	local since=$SECONDS
	for r in "${regions[@]}"; do wait_sources "$since" "$r"; done

	local admin_seed=()
	for r in "${regions[@]}"; do
		redis_addrs=$(printf '127.0.0.1:%s,' ${redis_ports[$r]})
		redis_addrs=${redis_addrs%,}
		# us-east serves the admin example: it alone writes the rules bucket.
		admin_seed=()
		if [ "$r" = us-east ]; then admin_seed=(--admin.nats-nkey-seed-file "$auth_dir/admin.nk"); fi
		start "limiterd-$r" "$state/logs/limiterd-$r.log" "$bin/limiterd" \
			--region "$r" --region.topology-file "$(topology_file "$r")" --region.peer-secret-file "$peer_secret_file" \
			--rules.file "$rules" --redis.addrs "$redis_addrs" \
			--grpc.listen-address "${grpc_addr[$r]}" --http.listen-address "${http_addr[$r]}" \
			--nats.url "nats://${nats_addr[$r]}" --nats.nkey-seed-file "$auth_dir/limiterd-$r.nk" "${admin_seed[@]}" \
			--gossip.interval "$interval" --instance "limiterd-$r" --admin.token-file "$token_file" \
			${limiterd_flags[@]+"${limiterd_flags[@]}"}
	done
	for r in "${regions[@]}"; do wait_healthy "limiterd-$r" "${http_addr[$r]}" /readyz; done

	if [ -n "$monitoring" ]; then start_monitoring; fi

	trap - EXIT INT TERM
	echo
	echo "Three regions are up (rules $rules, gossip interval $interval):"
	for r in "${regions[@]}"; do
		printf '  %-8s limiterd gRPC %s  HTTP http://%s/metrics  reconciler http://%s/metrics  Redis 127.0.0.1:%s  NATS nats://%s\n' \
			"$r" "${grpc_addr[$r]}" "${http_addr[$r]}" "${rec_addr[$r]}" "${redis_ports[$r]// /,}" "${nats_addr[$r]}"
	done
	echo "  NATS     a supercluster: each region's server is its NATS cluster, joined by gateways (127.0.0.1:7222-7224);"
	echo "           JetStream; nkey users only, seeds in $auth_dir; monitoring http://${nats_mon[us-east]} (and 8223, 8224)"
	if [ -n "$wan_on" ]; then
		echo "  WAN      one-way delays $(wan_summary) (WAN=0: none), by wanproxy in front of every gateway"
		echo "           (127.0.0.1:17222-17224) and Peer address (127.0.0.1:18082-18282); health http://$wan_http/healthz"
	else
		echo "  WAN      none (WAN=0): the regions are on loopback"
	fi
	echo "  logs     $state/logs/ (Redis nodes: $state/redis/<region>/<port>/redis.log)"
	echo "  topology $state/topology.yml${wan_on:+ (each region reads its own, topology-<region>.yml, naming the Peer proxies)}"
	echo "  admin    bearer token in $token_file (mode 0600); from the repo root, put a rule and read it back:"
	echo
	admin_example
	echo
	if [ -n "$monitoring" ]; then
		echo "Monitoring (scrape and evaluation every $mon_interval, rules $mon_rules, data in $state/prometheus, $state/alertmanager):"
		echo "  Prometheus   http://$prom_addr (alerts: http://$prom_addr/alerts, targets: http://$prom_addr/targets)"
		echo "  Alertmanager http://$am_addr (API: http://$am_addr/api/v2/alerts)"
		echo "  Redis        every node through redis_exporter http://$redis_exporter_addr/scrape?target=redis://127.0.0.1:7000 (job redis)"
		echo "  NATS         every server through natsexporter http://$nats_exporter_addr/scrape?target=${nats_mon[us-east]} (job nats)"
		echo
	fi
	echo "Try: make demo; stop with: make down"
}

# health_of NAME: "ADDR PATH" that answers 200 when the process NAME is
# healthy.
health_of() {
	case $1 in
	nats-*) echo "${nats_mon[${1#nats-}]} /healthz" ;;
	reconciler-*) echo "${rec_addr[${1#reconciler-}]} /readyz" ;;
	limiterd-*) echo "${http_addr[${1#limiterd-}]} /readyz" ;;
	prometheus) echo "$prom_addr /-/ready" ;;
	alertmanager) echo "$am_addr /-/ready" ;;
	redis-exporter) echo "$redis_exporter_addr /health" ;;
	nats-exporter) echo "$nats_exporter_addr /metrics" ;;
	wanproxy) echo "$wan_http /healthz" ;;
	esac
}

# redis_node NAME: "REGION PORT" of a Redis node's name (redis-us-east:7001),
# or nothing.
redis_node() {
	local r p
	for r in "${regions[@]}"; do
		for p in ${redis_ports[$r]}; do
			if [ "$1" = "redis-$r:$p" ]; then echo "$r $p"; fi
		done
	done
}

# stop_one NAME: stop one recorded process (or Redis node) by its pid.
stop_one() {
	local name=$1 pid binary logf r p node
	node=$(redis_node "$name")
	if [ -n "$node" ]; then
		read -r r p <<<"$node"
		pid=$(cat "$state/redis/$r/$p/redis.pid" 2>/dev/null) || { err "$name is not running"; return 1; }
		[ "$(cat "/proc/$pid/comm" 2>/dev/null)" = redis-server ] || { err "$name is not running"; return 1; }
		kill "$pid"
		for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
		rm -f "$state/redis/$r/$p/redis.pid"
		log "stopped $name (pid $pid)"
		return 0
	fi
	read -r _ pid binary logf < <(grep "^$name " "$pids_file" 2>/dev/null | tail -n 1) || true
	if [ -z "${pid:-}" ] || ! alive "$pid" "$binary"; then
		err "$name is not running (see scripts/stack.sh status)"
		return 1
	fi
	kill "$pid"
	for _ in $(seq 100); do alive "$pid" "$binary" || break; sleep 0.1; done
	if alive "$pid" "$binary"; then
		err "$name (pid $pid) still running 10 s after SIGTERM: sending SIGKILL"
		kill -9 "$pid" 2>/dev/null || true
	fi
	log "stopped $name (pid $pid)"
}

# start_one NAME: start again, with the command line `up` used, a process
# stop_one stopped; wait until it is healthy.
start_one() {
	local name=$1 pid binary logf r p node args n rest
	node=$(redis_node "$name")
	if [ -n "$node" ]; then
		read -r r p <<<"$node"
		scripts/redis-cluster.sh restart "$state/redis/$r" "$p" >>"$state/logs/redis-$r.log" 2>&1 ||
			{ err "$name did not start again"; tail_log "$state/redis/$r/$p/redis.log"; return 1; }
		log "$name started again (pid $(cat "$state/redis/$r/$p/redis.pid")), cluster_state:ok"
		return 0
	fi
	[ -f "$cmd_dir/$name" ] || { err "no component $name (see scripts/stack.sh status)"; return 1; }
	read -r _ pid binary logf < <(grep "^$name " "$pids_file" | tail -n 1) || true
	if [ -n "${pid:-}" ] && alive "$pid" "$binary"; then
		err "$name is already running (pid $pid)"
		return 1
	fi
	eval "args=($(cat "$cmd_dir/$name"))"
	logf=${args[0]} binary=${args[1]}
	echo "---- started again by scripts/stack.sh start $name ----" >>"$logf"
	nohup "$binary" "${args[@]:2}" </dev/null >>"$logf" 2>&1 &
	pid=$!
	# The new pid takes the old one's line: `down` stops in start-up order.
	while read -r n rest; do
		if [ "$n" = "$name" ]; then echo "$name $pid $binary $logf"; else echo "$n $rest"; fi
	done <"$pids_file" >"$pids_file.new"
	mv "$pids_file.new" "$pids_file"
	# shellcheck disable=SC2046 # ADDR PATH
	wait_healthy "$name" $(health_of "$name")
}

status() {
	local name pid binary logf addr
	if [ ! -f "$pids_file" ]; then
		echo "stack: not up (no $pids_file)"
		return 0
	fi
	while read -r name pid binary logf; do
		addr=$(health_of "$name")
		if ! alive "$pid" "$binary"; then
			printf '  %-18s pid %-7s DOWN  (log %s)\n' "$name" "$pid" "$logf"
		elif http_ok ${addr}; then
			printf '  %-18s pid %-7s ok    http://%s\n' "$name" "$pid" "${addr/ /}"
		else
			printf '  %-18s pid %-7s NOT READY (http://%s; log %s)\n' "$name" "$pid" "${addr/ /}" "$logf"
		fi
	done <"$pids_file"
	for r in "${regions[@]}"; do
		for p in ${redis_ports[$r]}; do
			pid=$(cat "$state/redis/$r/$p/redis.pid" 2>/dev/null || echo "-")
			if redis-cli -p "$p" cluster info 2>/dev/null | grep -q cluster_state:ok; then
				printf '  %-18s pid %-7s ok    127.0.0.1:%s\n' "redis-$r:$p" "$pid" "$p"
			else
				printf '  %-18s pid %-7s DOWN  127.0.0.1:%s\n' "redis-$r:$p" "$pid" "$p"
			fi
		done
	done
}

down() {
	if [ ! -d "$state" ]; then
		log "nothing to stop (no $state)"
		return 0
	fi
	stop_all
	rm -rf "$state"
	log "down; removed $state"
}

case ${1:-} in
up) up ;;
down) down ;;
status) status ;;
admin-example) admin_example ;;
ports) every_port ;;
stop | start)
	[ -n "${2:-}" ] || { err "usage: scripts/stack.sh $1 NAME (a name scripts/stack.sh status shows)"; exit 2; }
	[ -f "$pids_file" ] || { err "the stack is not up (no $pids_file)"; exit 1; }
	"${1}_one" "$2"
	;;
nats-auth)
	[ -n "${2:-}" ] || { err "usage: scripts/stack.sh nats-auth DIR"; exit 2; }
	nats_auth "$2" "$GO" run ./internal/tools/natsauth
	;;
*)
	echo "usage: scripts/stack.sh up|down|status|admin-example|ports|stop NAME|start NAME|nats-auth DIR" >&2
	exit 2
	;;
esac
