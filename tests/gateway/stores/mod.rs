//! Where jobs and answers are kept: the store conformance suite and its properties, the embedded store, PostgreSQL and Redis as operators deploy them (TLS included), the Redis fast path, replay entries, encryption at rest, and outcomes surviving faults.

mod conformance;
mod embedded;
mod encryption;
mod fastpath;
mod outcomes_survive;
mod postgres_deployments;
mod postgres_restart;
mod postgres_tls;
mod redis_deployments;
mod redis_tls;
mod replay_entries;
mod state_machine_props;
