#!/usr/bin/env bash
# Runs every test against real PostgreSQL and Redis. This is the README's
# test command; it starts (and if need be installs) the services first.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
# Tests mostly wait on sockets and timers, so more threads than cores pays;
# past four, on two cores, the fast path's 50 ms Redis deadline and the
# gated upstreams' silences start to be outrun by the load itself.
cargo test --locked --workspace --no-fail-fast -- --test-threads "${IDEMGATE_TEST_THREADS:-4}"
