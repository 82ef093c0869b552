//! Streamed answers: recorded once, read by every client of the job.
//!
//! An answer whose content type the route streams (`text/event-stream` by
//! default) is not buffered before anyone sees it. Its attempt writes each
//! chunk into one [`Recording`] as it arrives; the first client and every
//! duplicate that joins read from it at their own pace (`docs/design.md`,
//! §10):
//!
//! - one copy per stream in flight, however many readers: a reader holds an
//!   index and clones of `Bytes`, never a queue, so a slow reader costs no
//!   memory and never stalls the upstream or the other readers;
//! - chunks are released as they arrive, but the **end** of the body only
//!   once the whole answer is committed: a client that saw a complete stream
//!   can always get it again;
//! - a stream cut before its end (reset, silence past the timeout, too
//!   large, or its commit lost) ends every reader's body with an error, so
//!   no client mistakes part of a stream for the whole;
//! - a server-sent event stream is recorded event by event (a partial
//!   event waits for its end), and its heartbeats (comment lines before an
//!   event) reach the readers of this recording but are not part of the
//!   answer: what is committed, mirrored and replayed is the same whether
//!   or not the upstream sent any (`docs/design.md` §10, "Heartbeats").

pub(crate) mod join;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use bytes::{Bytes, BytesMut};
use http::Response;
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use tokio::sync::watch;

use idemgate_domain::id::JobId;
use idemgate_domain::sse::{Blocks, Kind};
use idemgate_store::fastpath::{Ending, Piece};

use idemgate_domain::response::StoredResponse;
use idemgate_proxy::budget::Charge;
use idemgate_proxy::http::{Body, BodyError};

/// Where a recording stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// Chunks are still coming.
    Live,
    /// The whole answer is committed: readers may end.
    Committed,
    /// Cut before its end: readers fail.
    Cut,
    /// Its end came, but it is not the job's answer (an error the route
    /// retries, reported in band): readers end as the upstream ended, and
    /// nothing was committed (`docs/design.md` §10).
    Uncommitted,
}

#[derive(Debug, Clone, Copy)]
struct Progress {
    chunks: usize,
    end: End,
}

/// A recorded piece of a stream.
#[derive(Debug, Clone)]
struct Chunk {
    bytes: Bytes,
    /// A heartbeat: read live, not part of the answer.
    beat: bool,
}

/// What a recording holds: its chunks, and for an event stream the part
/// of an event that has not ended yet.
#[derive(Debug, Default)]
struct Chunks {
    list: Vec<Chunk>,
    /// Cuts an event stream at its events; `None` for other stream types,
    /// recorded chunk by chunk as they come.
    events: Option<Blocks>,
}

/// One streamed answer being recorded.
pub(crate) struct Recording {
    job: JobId,
    status: u16,
    headers: Vec<(String, Bytes)>,
    chunks: Mutex<Chunks>,
    progress: watch::Sender<Progress>,
    /// What its chunks hold against the memory budget, for as long as any
    /// reader holds the recording (`docs/design.md` §18).
    charge: Arc<Charge>,
}

impl std::fmt::Debug for Recording {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recording")
            .field("job", &self.job)
            .field("status", &self.status)
            .field("progress", &*self.progress.borrow())
            .finish_non_exhaustive()
    }
}

impl Recording {
    /// A recording of job `job`'s answer, with the status and end-to-end
    /// headers every reader gets, its chunks counted on `charge`.
    pub(crate) fn new(
        job: JobId,
        status: u16,
        headers: Vec<(String, Bytes)>,
        charge: Arc<Charge>,
    ) -> Arc<Self> {
        metrics::gauge!("idemgate_streams_in_flight").increment(1.0);
        let events = is_event_stream(&headers).then(Blocks::default);
        Arc::new(Recording {
            job,
            status,
            headers,
            chunks: Mutex::new(Chunks {
                list: Vec::new(),
                events,
            }),
            progress: watch::Sender::new(Progress {
                chunks: 0,
                end: End::Live,
            }),
            charge,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Chunks> {
        self.chunks.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The job it records.
    pub(crate) fn job(&self) -> JobId {
        self.job
    }

    /// Takes in what the upstream sent next and wakes the readers: an event
    /// stream's whole events and heartbeats, anything else as it came.
    pub(crate) fn push(&self, chunk: Bytes) {
        metrics::counter!("idemgate_streamed_bytes_total").increment(chunk.len() as u64);
        self.charge.add(chunk.len());
        let chunks = {
            let mut all = self.lock();
            let Chunks { list, events } = &mut *all;
            match events {
                None => list.push(Chunk {
                    bytes: chunk,
                    beat: false,
                }),
                Some(events) => coalesce(events.push(&chunk), list),
            }
            list.len()
        };
        self.progress.send_if_modified(|p| {
            let more = p.chunks != chunks;
            p.chunks = chunks;
            more
        });
    }

    /// The answer as recorded so far, for the commit: every chunk but the
    /// heartbeats, and a line not ended yet (unless it is a heartbeat's).
    pub(crate) fn stored(&self) -> StoredResponse {
        let chunks = self.lock();
        let answer = || chunks.list.iter().filter(|c| !c.beat).map(|c| &c.bytes[..]);
        let pending = chunks
            .events
            .as_ref()
            .map_or(&[][..], Blocks::pending_answer);
        let mut body =
            BytesMut::with_capacity(answer().map(<[u8]>::len).sum::<usize>() + pending.len());
        for bytes in answer() {
            body.extend_from_slice(bytes);
        }
        body.extend_from_slice(pending);
        StoredResponse {
            status: self.status,
            headers: self.headers.clone(),
            body: body.freeze(),
        }
    }

    /// The answer is committed: readers get the end of the body, after a
    /// line the upstream never ended (part of the answer, unless it is a
    /// heartbeat's).
    pub(crate) fn finish(&self) {
        self.flush();
        self.end(End::Committed);
    }

    /// The stream ended, and is not the job's answer: readers get what the
    /// upstream sent and its end, and nothing is committed.
    pub(crate) fn end_uncommitted(&self) {
        self.flush();
        self.end(End::Uncommitted);
    }

    /// Gives readers an event stream's last line the upstream never ended.
    fn flush(&self) {
        let chunks = {
            let mut all = self.lock();
            if let Some(rest) = all.events.as_mut().and_then(Blocks::finish) {
                all.list.push(Chunk {
                    beat: rest.kind == Kind::Beat,
                    bytes: rest.bytes,
                });
            }
            all.list.len()
        };
        self.progress.send_modify(|p| p.chunks = chunks);
    }

    /// The stream was cut: readers' bodies fail.
    pub(crate) fn cut(&self) {
        metrics::counter!("idemgate_streams_cut_total").increment(1);
        self.end(End::Cut);
    }

    fn end(&self, end: End) {
        let mut changed = false;
        self.progress.send_if_modified(|p| {
            changed = p.end == End::Live;
            if changed {
                p.end = end;
            }
            changed
        });
        if changed {
            metrics::gauge!("idemgate_streams_in_flight").decrement(1.0);
        }
    }

    /// Where it stands.
    pub(crate) fn state(&self) -> End {
        self.progress.borrow().end
    }

    /// The answer for one reader: everything recorded so far, then the rest
    /// as it comes. A joiner's is marked `Idempotent-Replayed: true`.
    pub(crate) fn response(self: &Arc<Self>, replayed: bool) -> Response<Body> {
        let mut response = Response::new(self.reader());
        *response.status_mut() = crate::replay::replayed_status(self.status);
        crate::replay::set_headers(&mut response, &self.headers);
        crate::replay::set_job(&mut response, self.job);
        if replayed {
            crate::replay::mark_replayed(&mut response);
        }
        response
    }

    fn chunk(&self, index: usize) -> Option<Bytes> {
        self.lock().list.get(index).map(|c| c.bytes.clone())
    }

    /// Every chunk, heartbeats too, from the first, then each as it comes,
    /// then the verdict (a recording dropped without one counts as cut):
    /// what a reader here reads, and what is mirrored for readers on other
    /// replicas (whose copies tell heartbeats apart again).
    pub(crate) fn follow(
        self: &Arc<Self>,
    ) -> impl futures_util::Stream<Item = Piece> + Send + 'static {
        let progress = self.progress.subscribe();
        futures_util::stream::unfold(
            (self.clone(), 0usize, progress, false),
            |(recording, index, mut progress, done)| async move {
                if done {
                    return None;
                }
                loop {
                    let now = *progress.borrow_and_update();
                    if index < now.chunks {
                        let chunk = recording.chunk(index)?;
                        let next = (recording, index + 1, progress, false);
                        return Some((Piece::Chunk(chunk), next));
                    }
                    let ending = match now.end {
                        End::Live => None,
                        End::Committed => Some(Ending::Committed),
                        End::Cut => Some(Ending::Cut),
                        End::Uncommitted => Some(Ending::Uncommitted),
                    };
                    if let Some(ending) = ending {
                        return Some((Piece::End(ending), (recording, index, progress, true)));
                    }
                    if progress.changed().await.is_err() {
                        let cut = Piece::End(Ending::Cut);
                        return Some((cut, (recording, index, progress, true)));
                    }
                }
            },
        )
    }

    /// A body that reads the recording from its first chunk, heartbeats
    /// and all: it ends once the answer is committed, and fails if it was
    /// cut.
    fn reader(self: &Arc<Self>) -> Body {
        use futures_util::StreamExt;
        let frames = self.follow().filter_map(|next| async move {
            match next {
                Piece::Chunk(chunk) => Some(Ok(Frame::data(chunk))),
                Piece::End(Ending::Committed | Ending::Uncommitted) => None,
                Piece::End(Ending::Cut) => {
                    // Pending once first: the server flushes the head and
                    // the chunks it holds, which a stream cut before its
                    // first write would otherwise lose with the connection
                    // (the client would see no answer, not a cut one).
                    tokio::task::yield_now().await;
                    Some(Err(BodyError::new(
                        "the upstream's stream was cut before its end",
                    )))
                }
            }
        });
        BodyExt::boxed(StreamBody::new(frames))
    }
}

/// Appends `blocks` to `list`, the answer's blocks that follow one another
/// as one chunk (one frame to each reader, one mirrored entry), each run of
/// heartbeats as one of its own.
fn coalesce(blocks: Vec<idemgate_domain::sse::Block>, list: &mut Vec<Chunk>) {
    let mut blocks = blocks.into_iter().peekable();
    while let Some(first) = blocks.next() {
        let beat = first.kind == Kind::Beat;
        // One block is kept as it is; a run is copied once.
        let mut run: Option<BytesMut> = None;
        while let Some(next) = blocks.next_if(|b| (b.kind == Kind::Beat) == beat) {
            let run = run.get_or_insert_with(|| BytesMut::from(&first.bytes[..]));
            run.extend_from_slice(&next.bytes);
        }
        let bytes = run.map_or(first.bytes, BytesMut::freeze);
        list.push(Chunk { bytes, beat });
    }
}

/// Whether an answer with these headers is an uncompressed server-sent
/// event stream.
pub(crate) fn is_event_stream(headers: &[(String, Bytes)]) -> bool {
    let header = |name: &str| {
        let found = headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name));
        found.map(|(_, value)| &value[..])
    };
    idemgate_domain::sse::is_event_stream(header("content-type"), header("content-encoding"))
}

/// The same, of a response's head.
pub(crate) fn is_event_stream_head(headers: &http::HeaderMap) -> bool {
    let header = |name| headers.get(name).map(http::HeaderValue::as_bytes);
    idemgate_domain::sse::is_event_stream(
        header(http::header::CONTENT_TYPE),
        header(http::header::CONTENT_ENCODING),
    )
}

impl Drop for Recording {
    fn drop(&mut self) {
        // A recording dropped while live (its task died) counts as cut.
        if self.progress.borrow().end == End::Live {
            metrics::gauge!("idemgate_streams_in_flight").decrement(1.0);
        }
    }
}

/// The streams this gateway is recording, by job, for duplicates to join.
#[derive(Debug, Default)]
pub(crate) struct Recordings {
    live: Mutex<HashMap<JobId, Weak<Recording>>>,
}

impl Recordings {
    /// Makes `recording` joinable until it ends.
    pub(crate) fn insert(&self, recording: &Arc<Recording>) {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.retain(|_, r| r.upgrade().is_some_and(|r| r.state() == End::Live));
        live.insert(recording.job, Arc::downgrade(recording));
    }

    /// The live recording of `job`, if this gateway has one.
    pub(crate) fn live(&self, job: JobId) -> Option<Arc<Recording>> {
        let live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        live.get(&job)
            .and_then(Weak::upgrade)
            .filter(|r| r.state() == End::Live)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt;
    use idemgate_proxy::budget::Budget;

    fn charge() -> Arc<Charge> {
        Budget::new(1 << 20).open()
    }

    #[test]
    fn chunks_are_charged_for_as_long_as_the_recording_lives() {
        let budget = Budget::new(1 << 20);
        let r = Recording::new(JobId::new(), 200, vec![], budget.open());
        r.push(Bytes::from_static(b"12345"));
        r.push(Bytes::from_static(b"678"));
        assert_eq!(budget.in_use(), 8);
        let reader = r.clone();
        drop(r);
        assert_eq!(budget.in_use(), 8, "a reader still holds it");
        drop(reader);
        assert_eq!(budget.in_use(), 0);
    }

    async fn frames(body: Body) -> (Vec<Bytes>, Option<String>) {
        let mut body = body;
        let mut out = Vec::new();
        loop {
            match body.frame().await {
                None => return (out, None),
                Some(Ok(frame)) => out.extend(frame.into_data().ok()),
                Some(Err(e)) => return (out, Some(e.to_string())),
            }
        }
    }

    #[tokio::test]
    async fn readers_get_what_was_recorded_then_the_rest_and_end_only_once_committed() {
        let r = Recording::new(JobId::new(), 200, vec![], charge());
        r.push(Bytes::from_static(b"a"));
        let early = tokio::spawn(frames(r.response(false).into_body()));
        r.push(Bytes::from_static(b"b"));
        let late = r.response(true);
        assert_eq!(late.headers()["idempotent-replayed"], "true");
        let late = tokio::spawn(frames(late.into_body()));
        r.push(Bytes::from_static(b"c"));
        tokio::task::yield_now().await;
        assert!(!early.is_finished(), "no end before the commit");
        assert_eq!(r.stored().body, "abc");
        r.finish();
        for reader in [early, late] {
            let (chunks, error) = reader.await.unwrap();
            assert_eq!(chunks.concat(), b"abc");
            assert_eq!(error, None);
        }
    }

    #[tokio::test]
    async fn a_cut_fails_every_reader_after_what_was_recorded() {
        let r = Recording::new(JobId::new(), 200, vec![], charge());
        r.push(Bytes::from_static(b"partial"));
        let reader = tokio::spawn(frames(r.response(false).into_body()));
        r.cut();
        let (chunks, error) = reader.await.unwrap();
        assert_eq!(chunks.concat(), b"partial");
        assert!(error.unwrap().contains("cut"));
        r.finish();
        assert_eq!(r.state(), End::Cut, "a verdict is final");
    }

    #[tokio::test]
    async fn heartbeats_reach_readers_but_not_the_answer_and_events_come_whole() {
        let sse = vec![(
            "content-type".to_owned(),
            Bytes::from_static(b"text/event-stream"),
        )];
        let r = Recording::new(JobId::new(), 200, sse, charge());
        let reader = tokio::spawn(frames(r.response(false).into_body()));
        let mirror = tokio::spawn(r.follow().collect::<Vec<_>>());
        r.push(Bytes::from_static(b"data: 1\n\n: keep-alive\n\ndata: "));
        r.push(Bytes::from_static(b"2\n\n: keep-alive\n\ndata: cut sho"));
        assert_eq!(r.stored().body, "data: 1\n\ndata: 2\n\ndata: cut sho");
        r.finish();
        let (chunks, error) = reader.await.unwrap();
        assert_eq!(error, None);
        assert_eq!(
            chunks,
            [
                "data: 1\n\n",
                ": keep-alive\n\n",
                "data: 2\n\n",
                ": keep-alive\n\n",
                "data: cut sho"
            ],
            "whole events, heartbeats between them, then what was never ended"
        );
        let mirrored: Vec<_> = mirror
            .await
            .unwrap()
            .into_iter()
            .filter_map(|p| match p {
                Piece::Chunk(c) => Some(c),
                Piece::End { .. } => None,
            })
            .collect();
        assert_eq!(
            mirrored, chunks,
            "mirrored as read: a copy tells heartbeats apart"
        );
    }

    #[tokio::test]
    async fn events_that_came_together_are_read_together() {
        let sse = vec![(
            "content-type".to_owned(),
            Bytes::from_static(b"text/event-stream"),
        )];
        let r = Recording::new(JobId::new(), 200, sse, charge());
        let reader = tokio::spawn(frames(r.response(false).into_body()));
        r.push(Bytes::from_static(
            b"data: 1\n\ndata: 2\n\n: hb\n\n: hb\n\ndata: 3\n\ndata: 4",
        ));
        r.finish();
        let (chunks, _) = reader.await.unwrap();
        assert_eq!(
            chunks,
            [
                "data: 1\n\ndata: 2\n\n",
                ": hb\n\n: hb\n\n",
                "data: 3\n\n",
                "data: 4"
            ],
        );
    }

    #[tokio::test]
    async fn only_live_recordings_can_be_joined() {
        let streams = Recordings::default();
        let r = Recording::new(JobId::new(), 200, vec![], charge());
        streams.insert(&r);
        assert!(streams.live(r.job).is_some());
        r.finish();
        assert!(streams.live(r.job).is_none());
    }
}
