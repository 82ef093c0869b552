//! idemgate: a reverse proxy that makes retries safe.
//!
//! One client intent (an `Idempotency-Key` under an owner) is one **job**;
//! every try is an **attempt** under it; exactly one attempt's answer is
//! committed, by compare-and-swap, and replayed to every duplicate.
//!
//! Dependencies point one way:
//!
//! - the domain — [`job`], [`attempt`], [`key`], [`fingerprint`] — knows no
//!   HTTP and no database;
//! - [`store`] persists the domain (PostgreSQL), behind one small trait;
//! - the HTTP side — [`http`], [`upstream`], [`replay`], [`idempotency`] (the
//!   Tower layer), [`admin`], [`server`] — knows both;
//! - [`app`] assembles the runtime and the one Tower stack; [`config`] holds
//!   the settings, apart from those runtime handles.

/// Any error, boxed, as kept for its `source()` by the typed errors.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

// The domain.
pub mod attempt;
pub mod fingerprint;
pub mod job;
pub mod key;
pub mod transition;

// Persistence.
pub mod lease;
pub mod probe;
pub mod seal;
pub mod store;
pub mod supervise;
pub mod sweeper;

// HTTP and assembly.
pub mod admin;
pub mod app;
pub mod config;
pub mod console;
pub mod contract;
pub mod error;
pub mod fastpath;
pub mod http;
pub mod idempotency;
pub mod recording;
pub mod replay;
pub mod server;
pub mod shed;
pub mod telemetry;
pub mod trace;
pub mod upstream;
