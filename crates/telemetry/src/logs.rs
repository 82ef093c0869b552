//! The log's writer: lines are handed to a thread of their own and written
//! to stderr in batches (`docs/design.md` §12, "Access log").
//!
//! Written where it was logged, a line costs its request a `write` to
//! stderr: about half of what the access log's line per request cost a
//! passed-through request, in a profile (docs/performance.md). Here a line is copied into a shared
//! buffer under a lock held for the copy; the thread wakes at the first
//! line of a batch, lets lines gather for [`GATHER`], and writes them in
//! one `write`. A writer waits only when [`LIMIT`] bytes are waiting (its
//! disk or reader is slower than the log): no line is dropped. Warnings
//! and errors are written at once, after the lines waiting. The
//! [`Logs`] handle writes what is left when the process ends; [`flush`]
//! writes what is pending before a message written to stderr directly.

pub mod record;

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

/// How long the first line of a batch waits for more: 10 ms batches a busy
/// gateway's lines into about a hundred writes a second, and delays none
/// of them past what a person or a collector notices.
const GATHER: Duration = Duration::from_millis(10);

/// Bytes waiting at most before a writer waits for the thread (some
/// sixteen thousand access lines); the thread wakes early at half of it.
const LIMIT: usize = 4 << 20;

/// The lines not yet written, and whether the process is ending.
#[derive(Default)]
struct Pending {
    bytes: Vec<u8>,
    closed: bool,
    /// Writers waiting for room (woken only when there are some: a wake-up
    /// is a system call).
    waiting: usize,
}

#[derive(Default)]
struct Shared {
    pending: Mutex<Pending>,
    /// The thread waits here for a first line, a full buffer, or the end.
    arrived: Condvar,
    /// Writers wait here for room.
    taken: Condvar,
    /// Held from taking a batch to its end on stderr, so batches (and the
    /// lines written directly once closed) reach it in order.
    out: Mutex<()>,
}

/// The writer the log's formatter writes each line to.
#[derive(Clone)]
pub struct Batched(Arc<Shared>);

/// Ends the writer's thread when the process ends, writing what it holds.
pub struct Logs {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// One line, as the formatter writes it.
pub struct Line<'a> {
    shared: &'a Shared,
    /// A warning or an error: written at once (after the lines waiting),
    /// as the lines that tell why a process is about to die must not wait
    /// with it; they are few.
    at_once: bool,
}

/// The writer [`start`] made first, for [`flush`] and [`record`]'s lines.
static STARTED: OnceLock<Arc<Shared>> = OnceLock::new();

/// The format [`start`] was given first, and whether the filter lets the
/// access line's target through.
static FORMAT: OnceLock<(record::Format, bool)> = OnceLock::new();

fn format() -> record::Format {
    FORMAT
        .get()
        .map_or(record::Format::Text, |(format, _)| *format)
}

fn access_on() -> bool {
    FORMAT.get().is_none_or(|(_, on)| *on)
}

/// Writes a whole line (ending in a newline) among the others; to stderr
/// at once when no writer was started (a library's tests).
fn write_line(line: &[u8]) {
    match STARTED.get() {
        Some(shared) => shared.push(line),
        None => {
            let _ = std::io::stderr().write_all(line);
        }
    }
}

/// Writes the lines pending now: called before something is written to
/// stderr directly (the process's last error), so it comes after them.
pub fn flush() {
    if let Some(shared) = STARTED.get() {
        shared.write_pending(Vec::new(), &[]);
    }
}

/// A writer and its handle, for lines in `format`, the access line's
/// written if `access` (the filter lets [`record::ACCESS`] through at
/// `info`); the thread starts here.
pub fn start(format: record::Format, access: bool) -> std::io::Result<(Batched, Logs)> {
    let shared = Arc::new(Shared::default());
    let _ = STARTED.set(shared.clone());
    let _ = FORMAT.set((format, access));
    let worker = shared.clone();
    let thread = std::thread::Builder::new()
        .name("idemgate-logs".into())
        .spawn(move || worker.run())?;
    let logs = Logs {
        shared: shared.clone(),
        thread: Some(thread),
    };
    Ok((Batched(shared), logs))
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these leaves bytes, which are still lines.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// The thread: waits for a batch, writes it, until the end.
    fn run(&self) {
        let mut spare = Vec::new();
        while self.gather() {
            spare = self.write_pending(spare, &[]);
        }
        self.write_pending(spare, &[]);
    }

    /// Waits for a first line, then [`GATHER`] for more (less when the
    /// buffer fills or the process ends); false once closed.
    fn gather(&self) -> bool {
        let pending = lock(&self.pending);
        let pending = self
            .arrived
            .wait_while(pending, |p| p.bytes.is_empty() && !p.closed)
            .unwrap_or_else(PoisonError::into_inner);
        let (pending, _) = self
            .arrived
            .wait_timeout_while(pending, GATHER, |p| !p.closed && p.bytes.len() < LIMIT / 2)
            .unwrap_or_else(PoisonError::into_inner);
        !pending.closed
    }

    /// Takes what is pending (leaving `spare`'s room in its place) and
    /// writes it, then `tail`; returns the emptied buffer for the next batch.
    fn write_pending(&self, spare: Vec<u8>, tail: &[u8]) -> Vec<u8> {
        let _out = lock(&self.out);
        let mut batch = {
            let mut pending = lock(&self.pending);
            if pending.waiting > 0 {
                self.taken.notify_all();
            }
            std::mem::replace(&mut pending.bytes, spare)
        };
        // As with a line written where it was logged, a failed write
        // (stderr closed) has nobody to be told.
        let mut stderr = std::io::stderr().lock();
        let _ = stderr
            .write_all(&batch)
            .and_then(|()| stderr.write_all(tail));
        batch.clear();
        batch
    }

    /// Adds a line, waiting while the buffer is full; once closed, writes
    /// it (after what is left) directly.
    fn push(&self, line: &[u8]) {
        let mut pending = lock(&self.pending);
        while pending.bytes.len() >= LIMIT && !pending.closed {
            pending.waiting += 1;
            pending = self
                .taken
                .wait(pending)
                .unwrap_or_else(PoisonError::into_inner);
            pending.waiting -= 1;
        }
        if pending.closed {
            drop(pending);
            return self.write_now(line);
        }
        let before = pending.bytes.len();
        pending.bytes.extend_from_slice(line);
        let after = pending.bytes.len();
        drop(pending);
        // The thread waits untimed for a first line, and cuts its gathering
        // short at half the limit; it needs no other wake-up.
        if before == 0 || (before < LIMIT / 2 && after >= LIMIT / 2) {
            self.arrived.notify_one();
        }
    }

    /// Writes a line now, after the lines waiting.
    fn write_now(&self, line: &[u8]) {
        self.write_pending(Vec::new(), line);
    }
}

impl Write for Line<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.at_once {
            self.shared.write_now(buf);
        } else {
            self.shared.push(buf);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Batched {
    type Writer = Line<'a>;

    fn make_writer(&'a self) -> Self::Writer {
        Line {
            shared: &self.0,
            at_once: false,
        }
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Self::Writer {
        Line {
            shared: &self.0,
            at_once: *meta.level() <= tracing::Level::WARN,
        }
    }
}

impl Drop for Logs {
    /// Closes the buffer and waits for the thread to write what it holds;
    /// lines logged later are written as they come.
    fn drop(&mut self) {
        lock(&self.shared.pending).closed = true;
        self.shared.arrived.notify_one();
        self.shared.taken.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
