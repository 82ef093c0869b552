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

# A PostgreSQL of the benchmark's own, unless --database names one: the
# run's gateways and pgbench hold more than a default server's 100
# connections, and its load would disturb whatever else uses the shared
# one. Durable (fsync on), as the ceilings it is compared with are; stopped
# and removed when the run ends.
own_database=true
for arg in "$@"; do
  [ "$arg" = --database ] && own_database=false
done
if $own_database; then
  bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
  dir=$(mktemp -d /tmp/idemgate-bench-pg.XXXXXX)
  as_postgres=()
  if [ "$(id -u)" = 0 ]; then
    chown postgres "$dir"
    as_postgres=(runuser -u postgres --)
  fi
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  "${as_postgres[@]}" "$bin/initdb" -D "$dir/data" -A trust -U postgres >/dev/null
  stop_database() {
    "${as_postgres[@]}" "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null || true
    rm -rf "$dir"
  }
  trap stop_database EXIT
  "${as_postgres[@]}" "$bin/pg_ctl" -D "$dir/data" -l "$dir/log" -w \
    -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c max_connections=300" start >/dev/null
  echo "bench: PostgreSQL of its own on 127.0.0.1:$port (max_connections = 300)" >&2
  set -- --database "postgres://postgres@127.0.0.1:$port/postgres" "$@"
fi
target/release/examples/bench --binary target/release/idemgate "$@"
