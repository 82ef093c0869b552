//! A line written without `tracing`'s formatter, for the one line a busy
//! gateway writes per request: the access log's (`docs/design.md` §12,
//! "Access log").
//!
//! `tracing`'s formatter visits each field through `Debug`, formats the
//! time through `Display`, and walks the span's context; for the access
//! line that was about half of what the line cost a request, in a profile
//! (`docs/performance.md`, item 26). A [`Record`] writes the same line (the
//! same keys in JSON, the same `name=value` pairs in text) straight into a
//! buffer of its thread, and hands it to the log's writer as one line among
//! the others. Whether it is written is still the log's filter's choice:
//! the caller asks [`access_on`] first, which the filter answered at start.

use std::cell::RefCell;
use std::fmt;
use std::io::Write as _;
use std::time::SystemTime;

/// The access line's target, by which the log's filter (`RUST_LOG`) picks it.
pub const ACCESS: &str = "idemgate::access";

/// Whether the log's filter lets the access line through (`RUST_LOG`'s
/// directives for [`ACCESS`] at `info`, asked once at start; true in a
/// process that started no log).
pub fn access_on() -> bool {
    super::access_on()
}

/// How lines are written, as [`crate::init`] chose: JSON objects
/// (`IDEMGATE_LOG_FORMAT=json`) or text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `tracing_subscriber`'s text: `{time}  INFO {target}: {message} k=v …`.
    Text,
    /// `tracing_subscriber`'s JSON: `{"timestamp", "level", "fields", "target"}`.
    Json,
}

/// One line at `info`, its fields added in order, written by [`Record::write`].
pub struct Record<'a> {
    buf: &'a mut Vec<u8>,
    format: Format,
}

thread_local! {
    /// Each thread's line, reused: a line allocates nothing once its thread
    /// has written one as long.
    static BUF: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Writes one line at `info` from `target`: `fields` adds its fields to it.
pub fn info(target: &str, message: &str, fields: impl FnOnce(&mut Record<'_>)) {
    let format = super::format();
    BUF.with(|buf| {
        let mut buf = buf.borrow_mut();
        buf.clear();
        let mut record = Record::start(&mut buf, format, SystemTime::now(), target, message);
        fields(&mut record);
        record.end(target);
        super::write_line(&buf);
    });
}

impl<'a> Record<'a> {
    /// The line's head: its time, level, target (text) and message.
    fn start(
        buf: &'a mut Vec<u8>,
        format: Format,
        now: SystemTime,
        target: &str,
        message: &str,
    ) -> Self {
        let time = humantime::format_rfc3339_micros(now);
        match format {
            Format::Text => {
                let _ = write!(buf, "{time}  INFO {target}: {message}");
            }
            Format::Json => {
                let _ = write!(
                    buf,
                    "{{\"timestamp\":\"{time}\",\"level\":\"INFO\",\"fields\":{{\"message\":"
                );
                json_str(buf, message);
            }
        }
        Record { buf, format }
    }

    /// The line's tail: its target (JSON), and its end.
    fn end(self, target: &str) {
        match self.format {
            Format::Text => self.buf.push(b'\n'),
            Format::Json => {
                self.buf.extend_from_slice(b"},\"target\":");
                json_str(self.buf, target);
                self.buf.extend_from_slice(b"}\n");
            }
        }
    }

    fn name(&mut self, name: &str) {
        match self.format {
            Format::Text => {
                self.buf.push(b' ');
                self.buf.extend_from_slice(name.as_bytes());
                self.buf.push(b'=');
            }
            Format::Json => {
                self.buf.push(b',');
                json_str(self.buf, name);
                self.buf.push(b':');
            }
        }
    }

    /// A text field: quoted and escaped (as `tracing` writes a `&str`).
    pub fn str(&mut self, name: &str, value: &str) -> &mut Self {
        self.name(name);
        match self.format {
            Format::Text => {
                let _ = write!(self.buf, "{value:?}");
            }
            Format::Json => json_str(self.buf, value),
        }
        self
    }

    /// A field written as it displays, unquoted in text (as `tracing`
    /// writes `%value`), a string in JSON.
    pub fn display(&mut self, name: &str, value: &dyn fmt::Display) -> &mut Self {
        self.name(name);
        match self.format {
            Format::Text => {
                let _ = write!(self.buf, "{value}");
            }
            Format::Json => {
                // Through a string of its own only when it needs escaping.
                let start = self.buf.len();
                let _ = write!(self.buf, "\"{value}\"");
                let inner = &self.buf[start + 1..self.buf.len() - 1];
                if inner.iter().any(|&b| b == b'"' || b == b'\\' || b < 0x20) {
                    let text = String::from_utf8_lossy(inner).into_owned();
                    self.buf.truncate(start);
                    json_str(self.buf, &text);
                }
            }
        }
        self
    }

    /// A whole number.
    pub fn u64(&mut self, name: &str, value: u64) -> &mut Self {
        self.name(name);
        let _ = write!(self.buf, "{value}");
        self
    }

    /// A whole number that may be negative.
    pub fn i64(&mut self, name: &str, value: i64) -> &mut Self {
        self.name(name);
        let _ = write!(self.buf, "{value}");
        self
    }

    /// A number with a fraction, as `tracing` writes one (`1.0`, not `1`);
    /// JSON's `null` when it is not finite.
    pub fn f64(&mut self, name: &str, value: f64) -> &mut Self {
        self.name(name);
        if value.is_finite() || self.format == Format::Text {
            let _ = write!(self.buf, "{value:?}");
        } else {
            self.buf.extend_from_slice(b"null");
        }
        self
    }

    /// A flag.
    pub fn bool(&mut self, name: &str, value: bool) -> &mut Self {
        self.name(name);
        self.buf
            .extend_from_slice(if value { b"true" } else { b"false" });
        self
    }
}

/// `value` as a JSON string, escaped by `serde_json`.
fn json_str(buf: &mut Vec<u8>, value: &str) {
    let _ = serde_json::to_writer(buf, value);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(format: Format) -> String {
        let mut buf = Vec::new();
        let now = SystemTime::UNIX_EPOCH + std::time::Duration::from_micros(1_700_000_000_123_456);
        let mut record = Record::start(
            &mut buf,
            format,
            now,
            "idemgate::access",
            "request answered",
        );
        record
            .display("method", &"POST")
            .str("path", "/v1/\"odd\"\\path\u{1}")
            .display("job", &"quote\"d")
            .u64("status", 200)
            .f64("duration_ms", 1.25)
            .f64("nan", f64::NAN)
            .bool("complete", true);
        record.end("idemgate::access");
        String::from_utf8(buf).expect("a line is UTF-8")
    }

    #[test]
    fn a_json_line_is_one_object_with_tracings_keys_and_every_field_typed() {
        let text = line(Format::Json);
        assert!(
            text.ends_with("}\n") && text.matches('\n').count() == 1,
            "{text}"
        );
        let line: serde_json::Value = serde_json::from_str(&text).expect("one JSON object");
        assert_eq!(line["timestamp"], "2023-11-14T22:13:20.123456Z");
        assert_eq!(line["level"], "INFO");
        assert_eq!(line["target"], "idemgate::access");
        let fields = &line["fields"];
        assert_eq!(fields["message"], "request answered");
        assert_eq!(fields["method"], "POST");
        assert_eq!(fields["path"], "/v1/\"odd\"\\path\u{1}");
        assert_eq!(fields["job"], "quote\"d");
        assert_eq!(fields["status"], 200);
        assert_eq!(fields["duration_ms"], 1.25);
        assert!(fields["nan"].is_null());
        assert_eq!(fields["complete"], true);
    }

    #[test]
    fn a_text_line_reads_as_tracings_with_strings_quoted_and_escaped() {
        assert_eq!(
            line(Format::Text),
            "2023-11-14T22:13:20.123456Z  INFO idemgate::access: request answered \
             method=POST path=\"/v1/\\\"odd\\\"\\\\path\\u{1}\" job=quote\"d status=200 \
             duration_ms=1.25 nan=NaN complete=true\n"
        );
    }
}
