#!/usr/bin/env bash
# Replay throughput and latency with and without the Redis fast path, side
# by side in one run, against the same local upstream. Prints a table.
# Extra arguments go to the benchmark (--requests, --concurrency, --keys, --rounds).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
cargo build --release --locked --bin idemgate --example replay_bench
exec target/release/examples/replay_bench --binary target/release/idemgate "$@"
