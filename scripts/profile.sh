#!/usr/bin/env bash
# Profiles one scenario of the gateway under wrk and draws a flame graph:
#   scripts/profile.sh new|replay|replay-db|plain   -> target/profile/<scenario>.svg
# Builds a release binary with frame pointers and line tables (in its own
# target folder), starts an nginx upstream and one gateway on PostgreSQL +
# Redis on loopback, records `perf` for the load, and folds the stacks with
# inferno (installed with cargo when missing). Bounded: 5 s of load.
# replay-db replays from PostgreSQL alone: no Redis, the replay cache off
# (docs/performance.md, items 45-48); IDEMGATE_WORKER_RUNTIME=per_thread
# and IDEMGATE_WORKER_THREADS=1 reach the gateway as they would any run.
set -euo pipefail
cd "$(dirname "$0")/.."
scenario=${1:-new}
scripts/services.sh
command -v perf >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq linux-perf >/dev/null; }
command -v wrk >/dev/null || { apt-get update -qq; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk nginx >/dev/null; }
command -v inferno-flamegraph >/dev/null || cargo install --quiet inferno
RUSTFLAGS="-C force-frame-pointers=yes" CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
  CARGO_TARGET_DIR=target/profile-build cargo build --release --locked --bin idemgate
out=target/profile; mkdir -p "$out"; work=$(mktemp -d)
db=idemgate_profile_$$
psql -h 127.0.0.1 -U postgres -qc "CREATE DATABASE $db" >/dev/null
cat > "$work/nginx.conf" <<NG
daemon off; worker_processes 1; pid $work/nginx.pid; error_log $work/error.log warn;
events { worker_connections 4096; }
http { access_log off; client_body_temp_path $work/body;
server { listen 127.0.0.1:18180; location / { default_type application/json; return 200 '{"ok":1}'; } } }
NG
nginx -c "$work/nginx.conf" -p "$work" & ng=$!
fast_path=(--redis-url redis://127.0.0.1:6379/13)
if [ "$scenario" = replay-db ]; then
  echo "replay_cache_size = 0" > "$work/memory-off.toml"
  fast_path=(--config "$work/memory-off.toml")
fi
# Replicas on PostgreSQL and Redis need a shared owner salt and replay key.
IDEMGATE_OWNER_SALT=$(openssl rand -base64 32) IDEMGATE_REPLAY_KEY=$(openssl rand -base64 32) \
RUST_LOG=warn target/profile-build/release/idemgate serve --listen 127.0.0.1:18181 --admin-listen 127.0.0.1:18182 \
  --upstream http://127.0.0.1:18180 --database-url "postgres://postgres@127.0.0.1:5432/$db" \
  "${fast_path[@]}" >/dev/null & gw=$!
cleanup() { kill "$gw" 2>/dev/null; kill -TERM "$ng" 2>/dev/null; wait 2>/dev/null; psql -h 127.0.0.1 -U postgres -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null; rm -rf "$work"; }
trap cleanup EXIT
sleep 1
cat > "$work/load.lua" <<'L'
wrk.method = "POST"
wrk.body = '{"amount": 1000}'
wrk.headers["Content-Type"] = "application/json"
-- Keyed requests need an owner (the default source is this header).
wrk.headers["Authorization"] = "Bearer profile-client"
local n = 0
local mode = "new"
init = function(args) mode = args[1] end
request = function()
  n = n + 1
  if mode == "new" then wrk.headers["Idempotency-Key"] = "p" .. math.random(1e12) .. "-" .. n
  elseif mode == "replay" or mode == "replay-db" then wrk.headers["Idempotency-Key"] = "r" .. (n % 200) end
  return wrk.format(nil, "/v1/charges")
end
L
[ "${scenario#replay}" != "$scenario" ] && wrk -t1 -c8 -d2s -s "$work/load.lua" http://127.0.0.1:18181 -- replay >/dev/null
perf record -F 999 -g -p "$gw" -o "$work/perf.data" -- sleep 6 2>/dev/null &
perf=$!
wrk -t1 -c32 -d5s --latency -s "$work/load.lua" http://127.0.0.1:18181 -- "$scenario" | grep -E "Requests/sec|Non-2xx|50%|99%"
wait "$perf" || true
perf script -i "$work/perf.data" 2>/dev/null | inferno-collapse-perf > "$out/$scenario.folded"
inferno-flamegraph < "$out/$scenario.folded" > "$out/$scenario.svg"
echo "flame graph: $out/$scenario.svg"
