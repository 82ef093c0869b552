//! Background upkeep, each task under supervision: attempt leases renewed,
//! lapsed leases and expired jobs swept, upstreams probed against their
//! contracts.

pub mod lease;
pub mod probe;
pub mod supervise;
pub mod sweeper;
