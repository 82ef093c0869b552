//! Streamed answers (server-sent events): streamed, resumed, and cut when they fall silent.

mod inband;
mod resume;
mod stream_timeouts;
mod streaming;
