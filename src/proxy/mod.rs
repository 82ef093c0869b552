//! The proxy plumbing: accepting connections, normalising paths, shedding
//! load, forwarding to the upstreams over pooled connections, and answering
//! errors as `application/problem+json`. Knows nothing of jobs.

pub mod error;
pub mod http;
pub mod path;
pub mod server;
pub mod shed;
pub mod upstream;
