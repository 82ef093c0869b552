#!/usr/bin/env bash
# The benchmark: idemgate beside nginx as a plain reverse proxy, in one run,
# printed as one table (see examples/bench/main.rs). Installs wrk and nginx
# when they are missing, as services.sh does for PostgreSQL and Redis.
# Extra arguments go to the benchmark (--seconds, --rounds, --connections,
# --storm, --replicas 1,2,4, --only NAME).
set -euo pipefail
cd "$(dirname "$0")/.."
IDEMGATE_NO_BROWSER=1 scripts/services.sh
missing=()
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v nginx >/dev/null 2>&1 || missing+=(nginx)
command -v pgbench >/dev/null 2>&1 || missing+=(postgresql-contrib)
if [ ${#missing[@]} -gt 0 ]; then
  echo "bench: installing ${missing[*]}" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# The duplicate storm holds thousands of connections at once.
ulimit -n 65536 2>/dev/null || ulimit -n "$(ulimit -Hn)"
cargo build --release --locked --bin idemgate --example bench --example floor
exec target/release/examples/bench --binary target/release/idemgate "$@"
