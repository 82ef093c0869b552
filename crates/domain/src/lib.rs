//! The domain: what a job, an attempt, a key and a fingerprint are, and how
//! they may change. Pure: no HTTP server, no database, no clock of its own
//! (which worker thread serves a request, `worker`, is its one state).

#![warn(unreachable_pub, missing_docs)]

/// Any error, boxed, as kept for its `source()` by the typed errors of
/// every layer.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

pub mod attempt;
pub mod contract;
pub mod fingerprint;
pub mod id;
pub mod job;
pub mod jsonrpc;
pub mod key;
pub mod path;
pub mod reconcile;
pub mod response;
pub mod sse;
pub mod transition;
pub mod worker;
