//! Integration tests: the real binary over real sockets, against a real
//! PostgreSQL (one database per test) and a fake upstream.

mod support;

mod access_log;
mod alerts;
mod budget;
mod chat_example;
mod check;
mod console;
mod console_session;
mod core_answers;
mod core_outcomes;
mod core_races;
mod dashboard;
mod defences;
mod draft_conformance;
mod embedded;
mod encryption;
mod failover;
mod fastpath;
mod fingerprints;
mod helm_chart;
mod http2_listener;
mod image;
mod in_progress;
mod jobs_cli;
mod keys;
mod outcomes_survive;
mod owners;
mod paths;
mod postgres_deployments;
mod postgres_restart;
mod postgres_tls;
mod readme;
mod real_clients;
mod reconcile;
mod redis_deployments;
mod redis_tls;
mod replay_entries;
mod rollout;
mod state_machine_props;
mod store_conformance;
mod streaming;
mod tls;
mod traces;
mod upstream_pool;
