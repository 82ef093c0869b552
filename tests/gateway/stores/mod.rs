//! Where jobs and answers are kept: every store, PostgreSQL and Redis as deployed, Redis entries.

mod conformance;
mod embedded;
mod encryption;
mod fastpath;
mod lost_reply;
mod outcomes_survive;
mod postgres_deployments;
mod postgres_restart;
mod postgres_tls;
mod redis_deployments;
mod redis_tls;
mod replay_entries;
mod state_machine_props;
