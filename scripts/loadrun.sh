#!/usr/bin/env bash
# A bounded load run on loopback: a 3-primary Redis Cluster, one limiterd on
# it, and limiterbench at concurrency 1, 16 and 64, each next to the gRPC
# health check on the same server (the transport ceiling) and next to a
# limiterd that sends each check on its own (--redis.no-coalesce); then
# redis-benchmark's EVALSHA ceiling of the same token bucket script on one
# standalone node. Stops everything it started, by pid, when it ends.
#
#   scripts/loadrun.sh                 # 5 s per run
#   LOAD_DURATION=20s scripts/loadrun.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

duration=${LOAD_DURATION:-5s}
concurrencies=${LOAD_CONCURRENCY:-"1 16 64"}
base=${LOAD_PORT_BASE:-17300}
work=$(mktemp -d)
pids=()
cleanup() {
	for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
	for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
	scripts/redis-cluster.sh stop "$work/cluster" || true
	if [ -f "$work/single/redis.pid" ]; then kill "$(cat "$work/single/redis.pid")" 2>/dev/null || true; fi
	rm -rf "$work"
}
trap cleanup EXIT

go build -o bin/ ./cmd/limiterd ./cmd/limiterbench
scripts/redis-cluster.sh start "$work/cluster" $((base)) $((base + 1)) $((base + 2))

cat >"$work/rules.yml" <<'RULES'
rules:
  - id: bench
    capacity: 1000000
    refill_per_second: 1000000
RULES
# Two limiterd on the same cluster: coalescing (the default) and not.
grpc=127.0.0.1:$((base + 81))
grpc_single=127.0.0.1:$((base + 82))
redis_addrs=127.0.0.1:$base,127.0.0.1:$((base + 1)),127.0.0.1:$((base + 2))
bin/limiterd --rules.file "$work/rules.yml" --grpc.listen-address "$grpc" \
	--http.listen-address 127.0.0.1:$((base + 91)) --redis.addrs "$redis_addrs" \
	--redis.timeout 100ms --log.level warn &
pids+=($!)
bin/limiterd --rules.file "$work/rules.yml" --grpc.listen-address "$grpc_single" \
	--http.listen-address 127.0.0.1:$((base + 92)) --redis.addrs "$redis_addrs" \
	--redis.timeout 100ms --redis.no-coalesce --log.level warn &
pids+=($!)
for addr in "$grpc" "$grpc_single"; do
	for _ in $(seq 100); do
		(exec 3<>"/dev/tcp/${addr%:*}/${addr#*:}") 2>/dev/null && break
		sleep 0.1
	done
done

# cpu prints a limiterd's process CPU seconds, from its /metrics.
cpu() {
	exec 3<>"/dev/tcp/127.0.0.1/$1"
	printf 'GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n' >&3
	awk '/^process_cpu_seconds_total/ { print $2 }' <&3
	exec 3>&-
}

echo "== limiterd on a 3-primary cluster, $duration per run"
for c in $concurrencies; do
	for mode in health check single; do
		conns=$((c < 4 ? c : 4))
		target=$grpc
		bmode=$mode
		http_port=$((base + 91))
		if [ "$mode" = single ]; then target=$grpc_single; bmode=check; http_port=$((base + 92)); fi
		before=$(cpu "$http_port")
		bin/limiterbench --target "$target" --mode $bmode --rule bench --concurrency "$c" --conns "$conns" \
			--duration "$duration" --warmup 1s --keys 100000 --key-prefix "run$c$mode:" >"$work/out.txt"
		after=$(cpu "$http_port")
		# Warmup checks count too: the CPU was spent on them as well.
		checks=$(awk -v s="$duration" '/^checks\/s/ { r = $2 } END { print r }' "$work/out.txt")
		per=$(awk -v b="$before" -v a="$after" -v r="$checks" -v d="${duration%s}" 'BEGIN { printf "%.0f", (a - b) * 1e6 / (r * (d + 1)) }')
		printf '%-6s c=%-3s %s | %s | %s | %s | server CPU ~%s µs/check\n' "$mode" "$c" \
			"$(grep '^checks/s' "$work/out.txt" | tr -s ' ')" "$(grep '^latency p50' "$work/out.txt" | tr -s ' ')" \
			"$(grep '^latency p99 ' "$work/out.txt" | tr -s ' ')" "$(grep '^errors' "$work/out.txt" | tr -s ' ')" "$per"
		if [ "$mode" = check ]; then
			peak=$(grep '^checks/s' "$work/out.txt" | tr -s ' ' | cut -d' ' -f2)
		fi
	done
done

# Latency at half the highest rate reached, open loop (measured from each
# request's intended send time).
half=$(awk -v p="$peak" 'BEGIN { printf "%d", p / 2 }')
bin/limiterbench --target "$grpc" --mode check --rule bench --concurrency 64 --conns 4 --rate "$half" \
	--duration "$duration" --warmup 1s --keys 100000 --key-prefix "half:" >"$work/out.txt"
printf 'check  rate=%s (half the peak) | %s | %s | %s\n' "$half" \
	"$(grep '^latency p50' "$work/out.txt" | tr -s ' ')" "$(grep '^latency p99 ' "$work/out.txt" | tr -s ' ')" \
	"$(grep '^errors' "$work/out.txt" | tr -s ' ')"

echo "== redis-benchmark: the token bucket script (EVALSHA) on one standalone node"
mkdir -p "$work/single"
redis-server --port $((base + 50)) --bind 127.0.0.1 --save '' --appendonly no --daemonize yes \
	--dir "$work/single" --pidfile "$work/single/redis.pid" --logfile "$work/single/redis.log"
for _ in $(seq 50); do redis-cli -p $((base + 50)) ping >/dev/null 2>&1 && break; sleep 0.1; done
sha=$(redis-cli -p $((base + 50)) script load "$(bin/limiterbench --print-script token_bucket)")
for p in 1 16; do
	rps=$(redis-benchmark -p $((base + 50)) -c 50 -n 400000 -P $p -r 100000 -q \
		evalsha "$sha" 1 'rl:{__rand_int__}:bench' 1000000 1000000 1 | grep -o '[0-9.]* requests per second' | head -1)
	echo "EVALSHA -c 50 -P $p: $rps"
done
