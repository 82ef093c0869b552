//! Upstreams: failover and hedging, moving on from unknown outcomes, reconciling by asking, proven providers, and the connection pool.

pub(crate) mod failover;
mod move_on;
mod proven_providers;
mod reconcile;
mod upstream_pool;
