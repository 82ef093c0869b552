//! idemgate: a reverse proxy that makes retries safe.
//!
//! One client intent (an `Idempotency-Key` under an owner) is one **job**;
//! every try is an **attempt** under it; exactly one attempt's answer is
//! committed, by compare-and-swap, and replayed to every duplicate.
//!
//! The layers are crates of the workspace, and imports only point down
//! (`docs/design.md`, "Where things are"). From the ground up:
//! `idemgate-domain` (jobs, attempts, keys, transitions: no I/O) and
//! `idemgate-telemetry` → `idemgate-store` (the arbiter, and the Redis fast
//! path) → `idemgate-proxy` (server, upstream pool, problem answers; no
//! jobs) → `idemgate-trust` (who is asking) → `idemgate-upkeep` (background
//! tasks) → `idemgate-idempotency` (the Tower layer) and, beside it,
//! `idemgate-operations` (admin API, console) → this crate: [`config`],
//! which reads the settings and builds each crate's own, and [`app`], which
//! assembles one gateway for the binary to run.

#![warn(unreachable_pub, missing_docs)]

pub use idemgate_domain::BoxError;

pub mod app;
pub mod config;
