//! Streamed answers (server-sent events): streamed through while recorded, resumed where a client lost them, and cut when they fall silent.

mod resume;
mod stream_timeouts;
mod streaming;
