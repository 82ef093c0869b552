//! Server-sent events (the WHATWG `text/event-stream` format), as far as the
//! gateway needs them (`docs/design.md` §10, "Heartbeats" and "Resume"):
//! where one event ends, which `id` it carries, which blocks are only
//! heartbeats, and where a client that asks to resume picks up.
//!
//! - An **event** is a block of lines ending with a blank line that holds at
//!   least one field (`data:`, `event:`, `id:`, `retry:`, or any other
//!   name). Counted from 1; what a client that "received n events" has.
//! - A **heartbeat** is a run of comment lines (`: keep-alive`) and blank
//!   lines before a block's first field: forwarded to live readers, never
//!   recorded, never counted, so a replay is the same whether or not the
//!   upstream sent any. A comment between an event's fields is part of it.
//! - Lines end with CRLF, LF or CR, as the format allows; bytes are never
//!   rewritten, only cut at block boundaries.

use bytes::{Bytes, BytesMut};

/// Whether a `Content-Type` value names an event stream.
pub fn is_event_stream(content_type: &[u8]) -> bool {
    let essence = content_type
        .split(|b| *b == b';')
        .next()
        .unwrap_or_default();
    essence
        .trim_ascii()
        .eq_ignore_ascii_case(b"text/event-stream")
}

/// What a block of the stream is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// An event, with the value of its last `id` field if it has one.
    Event {
        /// Its `id`, when it names one.
        id: Option<String>,
    },
    /// Comment and blank lines only.
    Beat,
}

/// A block of the stream: its bytes, exactly as they came.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// The bytes, terminating blank line included.
    pub bytes: Bytes,
    /// What it is.
    pub kind: Kind,
}

/// Cuts a byte stream into [`Block`]s as it arrives. Bytes of an event not
/// yet ended (and of a line not yet ended) stay pending until its blank
/// line comes, or the stream ends ([`Blocks::rest`]).
#[derive(Debug, Default)]
pub struct Blocks {
    /// Bytes not yet given out in a block.
    pending: BytesMut,
    /// How far into `pending` whole lines were scanned.
    scanned: usize,
    /// Where the current heartbeat run ends (0: none).
    beat_end: usize,
    /// Whether the current block has a field (it is an event).
    field: bool,
    /// The current event's last `id`.
    id: Option<String>,
    /// Whether the stream's first line was seen (a byte order mark may
    /// precede it).
    started: bool,
}

impl Blocks {
    /// Takes `chunk` in and gives out every block it completes, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Block> {
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::new();
        while let Some((content, end)) = self.next_line() {
            self.line(content, end, &mut out);
        }
        // A heartbeat goes out as soon as it is whole, not with the event
        // that follows it: it is what keeps an idle client's connection up.
        if !self.field && self.beat_end > 0 {
            out.push(self.cut(self.beat_end, Kind::Beat));
        }
        out
    }

    /// The bytes still pending (an event or a line the stream never ended),
    /// given out as they are: they are part of the answer.
    pub fn rest(&mut self) -> Bytes {
        self.scanned = 0;
        self.beat_end = 0;
        self.field = false;
        self.id = None;
        self.pending.split().freeze()
    }

    /// The bytes still pending, left in place.
    pub fn peek(&self) -> &[u8] {
        &self.pending
    }

    /// The next whole line after `scanned`: its content's range and where
    /// it ends, terminator included. A CR last in what came so far may be
    /// the first half of a CRLF: it waits for the next byte.
    fn next_line(&mut self) -> Option<(std::ops::Range<usize>, usize)> {
        let start = self.scanned;
        let at = start + memchr::memchr2(b'\n', b'\r', &self.pending[start..])?;
        let end = match self.pending[at] {
            b'\r' if at + 1 == self.pending.len() => return None,
            b'\r' if self.pending[at + 1] == b'\n' => at + 2,
            _ => at + 1,
        };
        self.scanned = end;
        let mut content = start..at;
        if !self.started {
            self.started = true;
            if self.pending[content.clone()].starts_with("\u{feff}".as_bytes()) {
                content.start += 3;
            }
        }
        Some((content, end))
    }

    fn line(&mut self, content: std::ops::Range<usize>, end: usize, out: &mut Vec<Block>) {
        let line = &self.pending[content];
        match (line.first(), self.field) {
            // The blank line that ends an event.
            (None, true) => {
                let id = self.id.take();
                self.field = false;
                out.push(self.cut(end, Kind::Event { id }));
            }
            // Before any field, comments and blank lines are a heartbeat.
            (None | Some(b':'), false) => self.beat_end = end,
            // A comment inside an event is part of it.
            (Some(b':'), true) => {}
            (Some(_), _) => {
                if let Some(id) = id_field(line) {
                    self.id = Some(id);
                }
                if !self.field && self.beat_end > 0 {
                    let beat_end = self.beat_end;
                    out.push(self.cut(beat_end, Kind::Beat));
                }
                self.field = true;
            }
        }
    }

    /// Gives out the first `end` pending bytes as one block.
    fn cut(&mut self, end: usize, kind: Kind) -> Block {
        let bytes = self.pending.split_to(end).freeze();
        self.scanned -= end;
        self.beat_end = self.beat_end.saturating_sub(end);
        Block { bytes, kind }
    }
}

/// The value of an `id` field line, as a client's parser keeps it (a value
/// holding NUL is ignored by the format).
fn id_field(line: &[u8]) -> Option<String> {
    let value = match line.strip_prefix(b"id") {
        Some([]) => &[][..],
        Some([b':', b' ', value @ ..] | [b':', value @ ..]) => value,
        _ => return None,
    };
    if value.contains(&0) {
        return None;
    }
    Some(String::from_utf8_lossy(value).into_owned())
}

/// Every event of a whole stream (a stored answer): how many there are.
pub fn count_events(body: &[u8]) -> usize {
    let mut blocks = Blocks::default();
    let whole = blocks.push(body);
    whole
        .iter()
        .filter(|b| matches!(b.kind, Kind::Event { .. }))
        .count()
}

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
    /// Events skipped so far.
    skipped: usize,
    /// Whether the point was reached: the rest passes as it is.
    reached: bool,
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
        }
    }

    /// Events skipped so far.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// Whether the point was reached.
    pub fn reached(&self) -> bool {
        self.reached
    }

    /// Takes in the next chunk of the stream.
    pub fn push(&mut self, chunk: &[u8]) -> Skipped {
        if self.reached {
            return Skipped::Reached(Bytes::copy_from_slice(chunk));
        }
        let mut blocks = self.blocks.push(chunk).into_iter();
        for block in blocks.by_ref() {
            let Kind::Event { id } = block.kind else {
                continue;
            };
            self.skipped += 1;
            self.reached = match &self.point {
                ResumePoint::After(n) => self.skipped == *n,
                ResumePoint::AfterId(want) => id.as_deref() == Some(want),
            };
            if self.reached {
                let mut after = BytesMut::new();
                for rest in blocks.by_ref() {
                    after.extend_from_slice(&rest.bytes);
                }
                after.extend_from_slice(&self.blocks.rest());
                return Skipped::Reached(after.freeze());
            }
        }
        Skipped::Before
    }
}

#[cfg(test)]
mod tests;
