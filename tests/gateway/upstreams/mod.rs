//! Upstreams: failover, moving on, reconciling by asking, proven providers, the pool.

pub(crate) mod failover;
mod move_on;
mod proven_providers;
mod reconcile;
mod upstream_pool;
