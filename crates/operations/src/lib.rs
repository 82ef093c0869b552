//! What operators use: the admin API (jobs, resolution, health, readiness,
//! metrics), the console over it, and `idemgate jobs`, its command-line
//! client.

#![warn(unreachable_pub, missing_docs)]

pub mod admin;
pub mod cli;
pub mod console;
