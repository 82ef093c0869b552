//! Server-sent events (the WHATWG `text/event-stream` format), as far as the
//! gateway needs them (`docs/design.md` §10, "Heartbeats" and "Resume"):
//! where one event ends, which `id` it carries, which blocks are only
//! heartbeats, and where a client that asks to resume picks up.
//!
//! - An **event** is a block of lines ending with a blank line that holds at
//!   least one field (`data:`, `event:`, `id:`, `retry:`, or any other
//!   name). Those with a `data` field are the ones a client's parser
//!   dispatches (the format's rule; the OpenAI SDK yields one chunk for
//!   each): what a client that "received n events" counted.
//! - A **heartbeat** is a run of comment lines (`: keep-alive`) and blank
//!   lines before a block's first field: forwarded to live readers, never
//!   recorded, never counted, so a replay is the same whether or not the
//!   upstream sent any. A comment between an event's fields is part of it.
//! - Lines end with CRLF, LF or CR, as the format allows; bytes are never
//!   rewritten, only cut at block boundaries.

use bytes::{Bytes, BytesMut};

/// The SSE standard's header naming the last event a client has.
pub const LAST_EVENT_ID: &str = "last-event-id";
/// The gateway's header counting the events a client has, for streams
/// without ids.
pub const EVENTS_RECEIVED: &str = "idempotency-events-received";

/// Whether an answer with this `Content-Type` and `Content-Encoding` is an
/// event stream whose bytes are its events: a compressed one is not (its
/// bytes may hold a blank line anywhere), so it is never cut into events.
pub fn is_event_stream(content_type: Option<&[u8]>, content_encoding: Option<&[u8]>) -> bool {
    let essence = content_type
        .and_then(|t| t.split(|b| *b == b';').next())
        .unwrap_or_default();
    is_plain(content_encoding)
        && essence
            .trim_ascii()
            .eq_ignore_ascii_case(b"text/event-stream")
}

/// Whether an answer with this `Content-Encoding` is not compressed.
pub fn is_plain(content_encoding: Option<&[u8]>) -> bool {
    content_encoding.is_none_or(|e| e.trim_ascii().eq_ignore_ascii_case(b"identity"))
}

/// What a block of the stream is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// The end of an event (with whatever of it was not given out before
    /// as a [`Kind::Part`]), and what a client's parser makes of it.
    Event {
        /// The value of its last `id` field, if it has one: what a client
        /// then sends as `Last-Event-ID`.
        id: Option<String>,
        /// Whether it has a `data` field, so a client's parser dispatches it
        /// (the format's rule, and the OpenAI SDK's: one chunk each).
        dispatched: bool,
    },
    /// Whole lines of an event that has not ended yet: part of the answer,
    /// given out as they come so a reader never waits on a blank line.
    Part,
    /// Comment and blank lines only.
    Beat,
}

/// A block of the stream: its bytes, exactly as they came.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Block {
    /// The bytes.
    pub bytes: Bytes,
    /// What it is.
    pub kind: Kind,
}

/// A line longer than this that has not ended is given out as it is (as
/// what its start says it is): a stream that never ends its lines is not
/// held. An `id` field this long is ignored, however it arrives.
const LONGEST_LINE: usize = 64 * 1024;

const BOM: &[u8] = "\u{feff}".as_bytes();

/// What the rest of a line given out in part is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Continued {
    /// A comment's.
    Comment,
    /// A field's.
    Field,
}

/// Cuts a byte stream into [`Block`]s as it arrives. Only a line not yet
/// ended stays pending, until its end comes (or it grows past 64 KiB).
///
/// Between two pushes nothing but that line is pending: every whole line
/// is given out by the end of each push.
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
    /// Whether it has a `data` field.
    data: bool,
    /// The current event's last `id`.
    id: Option<String>,
    /// Whether the stream's first line was seen (a byte order mark may
    /// precede it).
    started: bool,
    /// The last push ended with a line ended by a lone CR: an LF first in
    /// the next is the rest of that line's end, not a blank line.
    after_cr: bool,
    /// The start of the pending line was given out already, as this.
    continued: Option<Continued>,
    /// Whether the last block given out was a heartbeat.
    last_beat: bool,
}

impl Blocks {
    /// Takes `chunk` in and gives out every block it completes, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Block> {
        self.pending.extend_from_slice(chunk);
        let mut out = Vec::new();
        self.absorb_lf(&mut out);
        while let Some((content, end)) = self.next_line() {
            self.line(content, end, &mut out);
        }
        // A heartbeat goes out as soon as it is whole, not with the event
        // that follows it: it is what keeps an idle client's connection up.
        if !self.field && self.beat_end > 0 {
            out.push(self.cut(self.beat_end, Kind::Beat));
        }
        if self.field && self.scanned > 0 {
            out.push(self.cut(self.scanned, Kind::Part));
        }
        if self.pending.len() > LONGEST_LINE {
            let kind = self.continue_line();
            out.push(self.cut(self.pending.len(), kind));
        }
        out
    }

    /// What is still pending at the end of the stream (a line it never
    /// ended), as what its start says it is: a comment's before any field
    /// is a heartbeat's, anything else part of the answer.
    pub fn finish(&mut self) -> Option<Block> {
        let kind = self.pending_kind();
        let rest = std::mem::take(self).pending.freeze();
        (!rest.is_empty()).then_some(Block { bytes: rest, kind })
    }

    /// The bytes still pending, whatever they are, given out as they are.
    pub fn rest(&mut self) -> Bytes {
        std::mem::take(self).pending.freeze()
    }

    /// The pending bytes that are part of the answer, left in place.
    pub fn pending_answer(&self) -> &[u8] {
        match self.pending_kind() {
            Kind::Beat => &[],
            _ => &self.pending,
        }
    }

    /// Whether the pending line (the start of which may have been given
    /// out) is a heartbeat's, or the answer's.
    fn pending_kind(&self) -> Kind {
        let comment = match self.continued {
            Some(continued) => continued == Continued::Comment,
            None => self.unended_line().first() == Some(&b':'),
        };
        if comment && !self.field {
            Kind::Beat
        } else {
            Kind::Part
        }
    }

    /// The line not yet ended, without a byte order mark before the first.
    fn unended_line(&self) -> &[u8] {
        let line = &self.pending[self.scanned..];
        match self.started {
            true => line,
            false => line.strip_prefix(BOM).unwrap_or(line),
        }
    }

    /// A line too long to hold: what it is, told from its start; the rest
    /// of it will be the same.
    fn continue_line(&mut self) -> Kind {
        let kind = self.pending_kind();
        if self.continued.is_none()
            && kind == Kind::Part
            && self.unended_line().first() != Some(&b':')
        {
            // A field's line: `data` makes its event dispatched; an `id`
            // this long is ignored, as it is when it arrives whole.
            if field(self.unended_line()).0 == b"data" {
                self.data = true;
            }
            self.field = true;
            self.continued = Some(Continued::Field);
        } else if self.continued.is_none() {
            self.continued = Some(Continued::Comment);
        }
        self.started = true;
        kind
    }

    /// An LF first in what came after a line ended by a lone CR is the rest
    /// of that line's end: it goes out on its own as what that line was (a
    /// heartbeat's stays out of the answer).
    fn absorb_lf(&mut self, out: &mut Vec<Block>) {
        if !self.after_cr || self.pending.is_empty() {
            return;
        }
        self.after_cr = false;
        if self.pending[0] == b'\n' {
            let kind = if self.last_beat {
                Kind::Beat
            } else {
                Kind::Part
            };
            self.scanned = 1;
            out.push(self.cut(1, kind));
        }
    }

    /// The next whole line after `scanned`: its content's range and where
    /// it ends, terminator included. A line ends at CRLF, LF, or a CR (at
    /// once, even last in what came so far: an LF that comes next is then
    /// the rest of its end, [`Blocks::absorb_lf`]).
    fn next_line(&mut self) -> Option<(std::ops::Range<usize>, usize)> {
        let start = self.scanned;
        let at = start + memchr::memchr2(b'\n', b'\r', &self.pending[start..])?;
        let end = match self.pending.get(at..at + 2) {
            Some(b"\r\n") => at + 2,
            _ => at + 1,
        };
        let lone_cr = self.pending[at] == b'\r' && end == at + 1;
        self.after_cr = lone_cr && end == self.pending.len();
        self.scanned = end;
        let mut content = start..at;
        if !self.started {
            self.started = true;
            if self.pending[content.clone()].starts_with(BOM) {
                content.start += BOM.len();
            }
        }
        Some((content, end))
    }

    fn line(&mut self, content: std::ops::Range<usize>, end: usize, out: &mut Vec<Block>) {
        match self.continued.take() {
            // The rest of a field's line: content, told apart already.
            Some(Continued::Field) => return,
            Some(Continued::Comment) => {
                if !self.field {
                    self.beat_end = end;
                }
                return;
            }
            None => {}
        }
        let line = &self.pending[content];
        match (line.first(), self.field) {
            // The blank line that ends an event.
            (None, true) => {
                let kind = Kind::Event {
                    id: self.id.take(),
                    dispatched: std::mem::take(&mut self.data),
                };
                self.field = false;
                out.push(self.cut(end, kind));
            }
            // Before any field, comments and blank lines are a heartbeat.
            (None | Some(b':'), false) => self.beat_end = end,
            // A comment inside an event is part of it.
            (Some(b':'), true) => {}
            (Some(_), _) => {
                match field(line) {
                    (b"id", value) if !value.contains(&0) && line.len() <= LONGEST_LINE => {
                        self.id = Some(String::from_utf8_lossy(value).into_owned());
                    }
                    (b"data", _) => self.data = true,
                    _ => {}
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
        self.scanned = self.scanned.saturating_sub(end);
        self.beat_end = self.beat_end.saturating_sub(end);
        self.last_beat = kind == Kind::Beat;
        Block { bytes, kind }
    }
}

/// A field line's name and value, as a client's parser splits it (one
/// space after the colon is not part of the value).
fn field(line: &[u8]) -> (&[u8], &[u8]) {
    match memchr::memchr(b':', line) {
        None => (line, &[]),
        Some(at) => {
            let value = &line[at + 1..];
            (&line[..at], value.strip_prefix(b" ").unwrap_or(value))
        }
    }
}

mod resume;
pub mod verdict;

pub use resume::{BadResumePoint, ResumePoint, Skip, Skipped};

#[cfg(test)]
mod tests;
