//! Resume points, and skipping a stream to one (`docs/design.md` §10,
//! "Resume").

use bytes::{Bytes, BytesMut};

use super::{Blocks, Kind};

/// Where a client asks to pick a stream up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResumePoint {
    /// After this many events, at least one (the gateway's
    /// `Idempotency-Events-Received`; 0 is no resume point).
    After(usize),
    /// After the first event whose `id` is this (SSE `Last-Event-ID`).
    AfterId(String),
}

/// Why a resume point cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadResumePoint {
    /// The count is not a whole number.
    #[error("Idempotency-Events-Received must be a whole number of events (0 or more), not {0:?}")]
    Count(String),
    /// A header came more than once.
    #[error("{0} was sent more than once; send it once")]
    Repeated(&'static str),
    /// `Last-Event-ID` is empty or not text.
    #[error("Last-Event-ID must be the id of the last event received, as text")]
    Id,
    /// Both were sent.
    #[error("send either Last-Event-ID or Idempotency-Events-Received, not both")]
    Both,
}

impl ResumePoint {
    /// The resume point of a request, from every line of its
    /// `Last-Event-ID` and `Idempotency-Events-Received` headers; `None`
    /// when it sent neither (the whole stream).
    pub fn parse<'a>(
        last_event_id: impl IntoIterator<Item = &'a [u8]>,
        received: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<Option<ResumePoint>, BadResumePoint> {
        let id = single(last_event_id, "Last-Event-ID")?;
        let count = single(received, "Idempotency-Events-Received")?;
        match (id, count) {
            (None, None) => Ok(None),
            (Some(_), Some(_)) => Err(BadResumePoint::Both),
            (Some(id), None) => match std::str::from_utf8(id) {
                Ok(id) if !id.is_empty() => Ok(Some(ResumePoint::AfterId(id.to_owned()))),
                _ => Err(BadResumePoint::Id),
            },
            (None, Some(count)) => {
                let text = String::from_utf8_lossy(count);
                // Digits only: no sign, no spaces, nothing a parser may read two ways.
                let bad = || BadResumePoint::Count(text.clone().into_owned());
                if !text.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                // Nothing received is no resume at all: a client may always
                // send its count, from its first try on.
                match text.parse::<usize>().map_err(|_| bad())? {
                    0 => Ok(None),
                    n => Ok(Some(ResumePoint::After(n))),
                }
            }
        }
    }
}

fn single<'a>(
    lines: impl IntoIterator<Item = &'a [u8]>,
    name: &'static str,
) -> Result<Option<&'a [u8]>, BadResumePoint> {
    let mut lines = lines.into_iter();
    let first = lines.next();
    match lines.next() {
        Some(_) => Err(BadResumePoint::Repeated(name)),
        None => Ok(first),
    }
}

/// Skips a stream's blocks up to a resume point, as they arrive: what
/// follows the point, byte for byte, is handed on.
#[derive(Debug)]
pub struct Skip {
    point: ResumePoint,
    blocks: Blocks,
    /// Dispatched events skipped so far.
    skipped: usize,
    /// Whether the point was reached: the rest passes as it is.
    reached: bool,
    /// The point's event ended with a lone CR last in what came: an LF
    /// first in what comes next is still that event's.
    drops_lf: bool,
}

/// What one chunk did to a [`Skip`].
#[derive(Debug, PartialEq, Eq)]
pub enum Skipped {
    /// The point is not reached yet.
    Before,
    /// The point is reached: these bytes follow it (possibly none), and
    /// the rest of the stream follows them as it is.
    Reached(Bytes),
}

impl Skip {
    /// Skips to `point`.
    pub fn new(point: ResumePoint) -> Self {
        Skip {
            reached: point == ResumePoint::After(0),
            point,
            blocks: Blocks::default(),
            skipped: 0,
            drops_lf: false,
        }
    }

    /// Dispatched events skipped so far.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// Whether the point was reached.
    pub fn reached(&self) -> bool {
        self.reached
    }

    /// Whether an LF first in what follows the point (once it is reached,
    /// with nothing after it yet) belongs to the point's event: it is then
    /// not handed on.
    pub fn drops_lf(&self) -> bool {
        self.drops_lf
    }

    /// Takes in the next chunk of the stream.
    pub fn push(&mut self, chunk: &[u8]) -> Skipped {
        if self.reached {
            return Skipped::Reached(Bytes::copy_from_slice(chunk));
        }
        let mut blocks = self.blocks.push(chunk).into_iter();
        for block in blocks.by_ref() {
            let Kind::Event { id, dispatched } = block.kind else {
                continue;
            };
            self.skipped += usize::from(dispatched);
            // A count is of events a client's parser dispatched; an id is
            // the client's last event id, which any event may set.
            self.reached = match &self.point {
                ResumePoint::After(n) => dispatched && self.skipped == *n,
                ResumePoint::AfterId(want) => id.as_deref() == Some(want),
            };
            if self.reached {
                let mut after = BytesMut::new();
                for rest in blocks.by_ref() {
                    after.extend_from_slice(&rest.bytes);
                }
                let after_cr = self.blocks.after_cr;
                after.extend_from_slice(&self.blocks.rest());
                self.drops_lf = after_cr && after.is_empty();
                return Skipped::Reached(after.freeze());
            }
        }
        Skipped::Before
    }
}
