//! The proxy plumbing: accepting connections, normalising paths, shedding
//! load, counting the bytes requests hold against the memory budget,
//! forwarding to the upstreams over pooled connections, and rendering
//! problem answers (`application/problem+json`). Knows nothing of jobs.

#![warn(unreachable_pub, missing_docs)]

pub mod budget;
pub mod http;
mod line;
pub mod path;
pub mod problem;
pub mod server;
pub mod shed;
pub mod upstream;
