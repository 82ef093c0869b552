//! What operators use: the admin API (jobs, resolution, health, readiness,
//! metrics) and the console over it.

pub mod admin;
pub mod console;
