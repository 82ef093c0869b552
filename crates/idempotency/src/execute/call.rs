//! What the watched upstream call of one attempt (`Task::call`,
//! `Task::stream`) keeps and answers (`docs/design.md` §5, §10, §11): silence past `first_byte_timeout` before the answer's head, or past
//! `stream_idle_timeout` between body chunks, makes the attempt `unknown` at
//! once and tells the request so, while the call goes on until the
//! attempt's deadline and may still commit; cancelled because another
//! attempt won, the call is dropped. A streamed answer is relayed into its
//! recording as it comes, and its end released only once committed; one
//! that goes silent is cut.

use std::time::Duration;

use tokio::time::Instant;

use crate::route::Silences;
use idemgate_proxy::http::Body;
use idemgate_proxy::upstream::{Fetched, UpstreamError};

/// How the upstream call ended.
pub(super) enum Call {
    Answered(Result<Fetched, UpstreamError>),
    /// The head of an answer the route streams; its body is still coming.
    Streaming(http::response::Parts, Body),
    Cancelled,
    DeadlinePassed,
}

/// How a watched piece of the call ended.
pub(super) enum Watched<T> {
    Done(T),
    Cancelled,
    DeadlinePassed,
}

/// How relaying a streamed body ended.
pub(super) enum Relayed {
    /// The upstream ended it.
    Ended,
    /// Cut short: what happened, and whose doing it was (the upstream's
    /// break, or the gateway's silence or deadline).
    Broke(String, idemgate_telemetry::ends::By),
    /// Another attempt won.
    Cancelled,
}

/// The silence timer of one call, across its head and its body: the
/// first byte's allowance until the head comes, the idle one after.
pub(super) struct Clock {
    pub(super) silence: std::pin::Pin<Box<tokio::time::Sleep>>,
    pub(super) silences: Silences,
    /// Whether the answer's head has come.
    pub(super) head_came: bool,
    pub(super) timed_out: bool,
}

impl Clock {
    pub(super) fn new(silences: Silences) -> Clock {
        Clock {
            silence: Box::pin(tokio::time::sleep(silences.first_byte)),
            silences,
            head_came: false,
            timed_out: false,
        }
    }

    /// The silence allowed now.
    pub(super) fn allowed(&self) -> Duration {
        if self.head_came {
            self.silences.stream_idle
        } else {
            self.silences.first_byte
        }
    }

    /// The head came: from now on the body's chunks are timed.
    pub(super) fn took_head(&mut self) {
        self.head_came = true;
        self.restart();
    }

    /// Something came: the allowance starts over.
    pub(super) fn restart(&mut self) {
        let at = Instant::now() + self.allowed();
        self.silence.as_mut().reset(at);
    }

    /// What the silence that fired is recorded as, naming its key.
    pub(super) fn detail(&self) -> String {
        let allowed = humantime::format_duration(self.allowed());
        if self.head_came {
            format!("the answer's body went silent for {allowed} (stream_idle_timeout)")
        } else {
            format!("no answer head within {allowed} (first_byte_timeout)")
        }
    }
}
