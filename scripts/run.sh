#!/usr/bin/env bash
# make run: limiterd with the example rules on the embedded in-memory store,
# and a NATS server with JetStream beside it, which holds the rules the
# admin API puts (PutRule, PutOverride) and the spends limiterd publishes
# (the last 10 minutes of them; no reconciler reads them in one region).
# Ctrl-C stops both.
#
# Everything lives under RUN_DIR (default $TMPDIR/limiterd-run, made afresh
# at each start): the admin API's bearer token (admin-token, mode 0600, a
# new random one each time), NATS's store and log, and the binaries.
# GRPC_ADDR, HTTP_ADDR and NATS_ADDR move the listeners (defaults
# 127.0.0.1:8081, 127.0.0.1:9091 and 127.0.0.1:14222). Arguments go to
# limiterd. Only the processes it starts are stopped, by their pids.
set -euo pipefail

GO=${GO:-go}
RULES=${RULES:-examples/rules.yml}
RUN_DIR=${RUN_DIR:-${TMPDIR:-/tmp}/limiterd-run}
GRPC_ADDR=${GRPC_ADDR:-127.0.0.1:8081}
HTTP_ADDR=${HTTP_ADDR:-127.0.0.1:9091}
NATS_ADDR=${NATS_ADDR:-127.0.0.1:14222}

rm -rf "$RUN_DIR"
mkdir -p "$RUN_DIR"
chmod 700 "$RUN_DIR"
nats_server=$("$GO" tool -n nats-server)
"$GO" build -o "$RUN_DIR/" ./cmd/limiterd ./internal/tools/localstream
(umask 077 && head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$RUN_DIR/admin-token")

nats_pid=
limiterd_pid=
stop() {
	for pid in $limiterd_pid $nats_pid; do
		kill "$pid" 2>/dev/null || true
		wait "$pid" 2>/dev/null || true
	done
}
trap stop EXIT
trap 'exit 130' INT TERM

"$nats_server" -js -a "${NATS_ADDR%:*}" -p "${NATS_ADDR##*:}" -sd "$RUN_DIR/nats" >"$RUN_DIR/nats.log" 2>&1 &
nats_pid=$!
up=
for _ in $(seq 100); do
	if (exec 3<>"/dev/tcp/${NATS_ADDR%:*}/${NATS_ADDR##*:}") 2>/dev/null; then
		up=1
		break
	fi
	if ! kill -0 "$nats_pid" 2>/dev/null; then
		echo "run: nats-server on $NATS_ADDR exited:" >&2
		cat "$RUN_DIR/nats.log" >&2
		exit 1
	fi
	sleep 0.1
done

if [ -z "$up" ]; then
	echo "run: nats-server on $NATS_ADDR not listening after 10 s" >&2
	exit 1
fi
"$RUN_DIR/localstream" --nats.url="nats://$NATS_ADDR"

echo "run: NATS on $NATS_ADDR (rules the admin API puts); admin token in $RUN_DIR/admin-token" >&2
"$RUN_DIR/limiterd" --rules.file="$RULES" --nats.url="nats://$NATS_ADDR" \
	--admin.token-file="$RUN_DIR/admin-token" \
	--grpc.listen-address="$GRPC_ADDR" --http.listen-address="$HTTP_ADDR" "$@" &
limiterd_pid=$!
wait "$limiterd_pid"
