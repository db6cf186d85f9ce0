#!/usr/bin/env bash
# Starts or stops a local Redis Cluster on loopback for load runs and the
# local stack. Every process it starts is recorded by pid in DIR and stopped
# by that pid only.
#
#   scripts/redis-cluster.sh start DIR PORT...   # 3+ ports: a cluster of primaries
#   scripts/redis-cluster.sh restart DIR PORT    # start one node again (it rejoins by its nodes.conf)
#   scripts/redis-cluster.sh stop DIR
set -euo pipefail

cmd=${1:?usage: redis-cluster.sh start DIR PORT... | restart DIR PORT | stop DIR}
dir=${2:?DIR missing}

# node DIR PORT: start the node of PORT, its files in DIR.
node() {
	redis-server --port "$2" --bind 127.0.0.1 --cluster-enabled yes \
		--cluster-config-file "$1/nodes.conf" --cluster-node-timeout 2000 \
		--save '' --appendonly no --dir "$1" --daemonize yes \
		--pidfile "$1/redis.pid" --logfile "$1/redis.log" \
		--maxmemory 512mb --maxmemory-policy noeviction
}

case "$cmd" in
restart)
	port=${3:?PORT missing}
	d="$dir/$port"
	[ -f "$d/nodes.conf" ] || { echo "redis-cluster: no node of port $port in $dir" >&2; exit 1; }
	if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
		echo "redis-cluster: 127.0.0.1:$port is already in use" >&2
		exit 1
	fi
	node "$d" "$port"
	for _ in $(seq 100); do
		if redis-cli -p "$port" cluster info 2>/dev/null | grep -q 'cluster_state:ok'; then
			echo "redis-cluster: 127.0.0.1:$port ok"
			exit 0
		fi
		sleep 0.1
	done
	echo "redis-cluster: 127.0.0.1:$port never reached cluster_state:ok" >&2
	exit 1
	;;
start)
	shift 2
	[ $# -ge 3 ] || { echo "redis-cluster: need at least 3 ports" >&2; exit 2; }
	mkdir -p "$dir"
	nodes=()
	for port in "$@"; do
		if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
			echo "redis-cluster: 127.0.0.1:$port is already in use" >&2
			exit 1
		fi
		d="$dir/$port"
		mkdir -p "$d"
		rm -f "$d/nodes.conf"
		node "$d" "$port"
		nodes+=("127.0.0.1:$port")
	done
	for port in "$@"; do
		for _ in $(seq 50); do
			redis-cli -p "$port" ping >/dev/null 2>&1 && break
			sleep 0.1
		done
	done
	redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >"$dir/create.log" 2>&1 ||
		{ cat "$dir/create.log" >&2; exit 1; }
	for port in "$@"; do
		ok=""
		for _ in $(seq 100); do
			if redis-cli -p "$port" cluster info 2>/dev/null | grep -q 'cluster_state:ok'; then ok=1; break; fi
			sleep 0.1
		done
		[ -n "$ok" ] || { echo "redis-cluster: 127.0.0.1:$port never reached cluster_state:ok" >&2; exit 1; }
	done
	echo "redis-cluster: ${nodes[*]} ok"
	;;
stop)
	for pidfile in "$dir"/*/redis.pid; do
		[ -f "$pidfile" ] || continue
		pid=$(cat "$pidfile")
		if kill "$pid" 2>/dev/null; then
			for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
		fi
		rm -f "$pidfile"
	done
	;;
*)
	echo "usage: redis-cluster.sh start DIR PORT... | restart DIR PORT | stop DIR" >&2
	exit 2
	;;
esac
