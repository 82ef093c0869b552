//! Background upkeep, each task under supervision: attempt leases renewed,
//! lapsed leases and expired jobs swept, upstreams probed against their
//! contracts, the store's and Redis' health watched.

#![warn(unreachable_pub, missing_docs)]

pub mod health;
pub mod lease;
pub mod probe;
pub mod supervise;
pub mod sweeper;
