//! What operators use: the console, the jobs CLI, `idemgate check`, logs, metrics, traces, rollouts.

mod access_log;
mod check;
mod console;
mod console_decided;
mod console_session;
mod documented;
mod jobs_cli;
mod metrics_count_once;
mod rollout;
mod tools;
mod traces;
mod who_decided;
