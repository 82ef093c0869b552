//! What operators use: the console and its session, the jobs CLI, `idemgate check`, the access log, traces, and rollouts.

mod access_log;
mod check;
mod console;
mod console_session;
mod jobs_cli;
mod rollout;
mod traces;
