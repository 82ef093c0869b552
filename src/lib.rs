//! idemgate: a reverse proxy that makes retries safe.
pub mod attempt;
pub mod fingerprint;
pub mod job;
pub mod key;
pub mod store;
