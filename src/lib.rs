//! idemgate: a reverse proxy that makes retries safe.
//!
//! One client intent (an `Idempotency-Key` under an owner) is one **job**;
//! every try is an **attempt** under it; exactly one attempt's answer is
//! committed, by compare-and-swap, and replayed to every duplicate.
//!
//! The folders are the layers, and imports only point down
//! (`docs/design.md`, "Where things are"). From the ground up:
//! [`domain`] (jobs, attempts, keys, transitions: no I/O) and [`telemetry`]
//! (logs, metrics, traces) → [`config`] (plain settings) → [`store`] (the
//! arbiter) → [`proxy`] (server, upstream pool, errors as problems) →
//! [`trust`] (who is asking: clients, owners) → [`upkeep`] (background
//! tasks) → [`idempotency`] (the Tower layer) and,
//! beside it, [`operations`] (admin API, console) → [`app`], which assembles
//! one gateway for the binary to run.

#![warn(unreachable_pub, missing_docs)]

pub use idemgate_domain::BoxError;

pub mod app;
pub mod config;
