//! idemgate: a reverse proxy that makes retries safe.
//!
//! One client intent (an `Idempotency-Key` under an owner) is one **job**;
//! every try is an **attempt** under it; exactly one attempt's answer is
//! committed, by compare-and-swap, and replayed to every duplicate.
//!
//! The folders are the layers, and imports only point down
//! (`docs/design.md`, "Where things are"):
//! [`domain`] (jobs, attempts, keys, transitions: no I/O) → [`store`] (the
//! arbiter) → [`proxy`] (server, upstream pool, errors as problems) →
//! [`idempotency`] (the Tower layer) → [`operations`] (admin, console); beside
//! them [`config`] (plain settings), [`upkeep`] (background tasks) and
//! [`telemetry`]; [`app`] assembles one gateway.

/// Any error, boxed, as kept for its `source()` by the typed errors.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub mod app;
pub mod config;
pub mod domain;
pub mod idempotency;
pub mod operations;
pub mod proxy;
pub mod store;
pub mod telemetry;
pub mod upkeep;
