//! The gateway's behaviour: the real binary over real sockets, against a
//! real PostgreSQL (one database per test), real Redis servers and fake
//! upstreams, grouped by subject.

#[path = "../support/mod.rs"]
mod support;

mod agents;
mod core;
mod operations;
mod owners_and_trust;
mod stores;
mod streams;
mod upstreams;
