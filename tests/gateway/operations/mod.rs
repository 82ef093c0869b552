//! What operators use: the console, the jobs CLI, `idemgate check`, logs, traces, rollouts.

mod access_log;
mod check;
mod console;
mod console_decided;
mod console_session;
mod documented;
mod jobs_cli;
mod rollout;
mod tools;
mod traces;
mod who_decided;
