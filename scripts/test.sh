#!/usr/bin/env bash
# Runs every test against real PostgreSQL and Redis. This is the README's
# test command. It checks for a Rust toolchain first (it installs none: a
# toolchain is rustup's to manage), then makes sure what the tests use is
# here (scripts/services.sh: PostgreSQL and Redis started, and installed
# from Debian's packages `postgresql` and `redis-server` when missing; curl,
# python3-venv and npm when missing; chromium and chromium-driver for the
# console's browser tests), then runs the whole workspace's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v cargo >/dev/null 2>&1; then
  echo "test: cargo is not on PATH; install a Rust toolchain (https://rustup.rs, 1.92 or newer) and run scripts/test.sh again" >&2
  exit 1
fi
echo "test: making sure PostgreSQL, Redis, curl, python3-venv, npm, chromium and chromium-driver are here (installing missing Debian packages)" >&2
scripts/services.sh
# Tests mostly wait on sockets and timers, so more threads than cores pays;
# past four, on two cores, the fast path's 50 ms Redis deadline and the
# gated upstreams' silences start to be outrun by the load itself.
cargo test --locked --workspace --no-fail-fast -- --test-threads "${IDEMGATE_TEST_THREADS:-4}"
