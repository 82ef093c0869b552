//! Streamed answers mirrored on Redis Streams, so that duplicates on other
//! replicas join them live.
//!
//! Every part of a mirrored stream is a record authenticated as replay
//! entries are (`docs/design.md` §17), bound to its job, its kind and its
//! position: the head is part 0, chunk `i` is chunk `i`, and the end
//! carries the number of chunks before it. So a reader takes chunks only in
//! order and one after another, never another job's, and believes an end
//! only when it counts every chunk it read: a stream cut short, reordered
//! or spliced is never served as complete.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};

use super::entry::{stream_key, Tag};
use super::keys::{Fields, Rejection, HEAD_LEN};
use super::FastPath;
use crate::domain::id::JobId;
use crate::store::codec::{decode_headers, encode_headers};
use crate::store::Doorbell;
use crate::BoxError;

/// Stream entry fields: the head, a chunk, the verdict; each is also the
/// record's kind, which its tag covers.
const HEAD: &str = "h";
const CHUNK: &str = "c";
const VERDICT: &str = "e";

/// The format of stream records; another is not believed.
const FORMAT: &[u8; 4] = b"IGS2";

/// A piece of a streamed answer as it is mirrored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// The next chunk of the body.
    Chunk(Bytes),
    /// The end: committed (the whole answer), or cut.
    End {
        /// Whether the answer was committed.
        committed: bool,
    },
}

impl FastPath {
    /// Mirrors `job`'s streamed answer on its Redis Stream as it grows (the
    /// head, each piece), in a task of its own and off every client's path,
    /// so duplicates on other replicas can join it live; announces the job
    /// once the head is there. Best effort: if Redis fails the mirror stops,
    /// and those duplicates complete the answer from the store.
    #[allow(clippy::too_many_arguments)] // the stream's own: job, head, pieces
    pub fn mirror(
        self: &Arc<Self>,
        tag: &Tag,
        job: JobId,
        (status, headers): (u16, &[(String, Bytes)]),
        pieces: impl Stream<Item = Piece> + Send + 'static,
        ttl: Duration,
        doorbell: Arc<Doorbell>,
    ) {
        let fast = self.clone();
        let key = stream_key(tag, job);
        let mut head = status.to_be_bytes().to_vec();
        head.extend_from_slice(&encode_headers(headers));
        tokio::spawn(async move {
            let mut conn = fast.redis.conn();
            let start = redis::pipe()
                .cmd("XADD")
                .arg(&key)
                .arg("*")
                .arg(HEAD)
                .arg(fast.record(job, HEAD, 0, &head))
                .ignore()
                .cmd("PEXPIRE")
                .arg(&key)
                .arg(ttl.as_millis() as u64)
                .ignore()
                .clone();
            if fast
                .call(start.query_async::<()>(&mut conn))
                .await
                .is_none()
            {
                return;
            }
            doorbell.ring(job);
            let mut pieces = std::pin::pin!(pieces);
            let mut chunks = 0u64;
            while let Some(piece) = pieces.next().await {
                let (field, value) = match piece {
                    Piece::Chunk(chunk) => {
                        chunks += 1;
                        (CHUNK, fast.record(job, CHUNK, chunks - 1, &chunk))
                    }
                    // The end counts the chunks before it.
                    Piece::End { committed } => {
                        (VERDICT, fast.record(job, VERDICT, chunks, &[committed as u8]))
                    }
                };
                let add = redis::cmd("XADD")
                    .arg(&key)
                    .arg("*")
                    .arg(field)
                    .arg(value)
                    .clone();
                if fast
                    .call(add.query_async::<String>(&mut conn))
                    .await
                    .is_none()
                {
                    return;
                }
            }
        });
    }

    /// The head (status, headers) of a stream another replica mirrors for
    /// `job`; `None` when Redis has none (or does not answer).
    pub async fn stream_head(&self, tag: &Tag, job: JobId) -> Option<(u16, Vec<(String, Bytes)>)> {
        let mut conn = self.redis.conn();
        let first = redis::cmd("XRANGE")
            .arg(stream_key(tag, job))
            .arg("-")
            .arg("+")
            .arg("COUNT")
            .arg(1)
            .clone();
        let reply: redis::streams::StreamRangeReply =
            self.call(first.query_async(&mut conn)).await?;
        let entry = reply.ids.first()?;
        let head = match self.open_record(job, HEAD, &entry.get::<Vec<u8>>(HEAD)?) {
            Ok((0, head)) => head,
            Ok(_) => return self.rejected("stream", Rejection::Truncated),
            Err(why) => return self.rejected("stream", why),
        };
        let (status, headers) = head.split_at_checked(2)?;
        Some((
            u16::from_be_bytes(status.try_into().ok()?),
            decode_headers(headers)?,
        ))
    }

    /// Hands each chunk of the Redis Stream `job`'s answer is mirrored on to
    /// `push`, from the start, until the verdict: whether the answer was
    /// committed. Fails when Redis fails, nothing arrives for `stall` (the
    /// replica recording it may have died), or a part does not verify or
    /// comes out of order (counted as a rejection): the caller then
    /// completes the answer from the store, which only appends to what was
    /// pushed, all of it verified.
    pub async fn feed(
        &self,
        tag: &Tag,
        job: JobId,
        stall: Duration,
        mut push: impl FnMut(Bytes),
    ) -> Result<bool, BoxError> {
        let key = stream_key(tag, job);
        // Blocking reads hold their connection: one of its own.
        let mut conn = self.redis.dedicated().await?;
        let mut last = "0".to_owned();
        let mut chunks = 0u64;
        let mut quiet_since = tokio::time::Instant::now();
        loop {
            let read = redis::cmd("XREAD")
                .arg("COUNT")
                .arg(256)
                .arg("BLOCK")
                .arg(1000)
                .arg("STREAMS")
                .arg(&key)
                .arg(&last)
                .clone();
            let reply: Option<redis::streams::StreamReadReply> =
                tokio::time::timeout(Duration::from_secs(3), read.query_async(&mut conn))
                    .await
                    .map_err(|_| "reading the stream from Redis timed out")??;
            let entries = reply.into_iter().flat_map(|r| r.keys).flat_map(|k| k.ids);
            let mut any = false;
            for entry in entries {
                any = true;
                last = entry.id.clone();
                let (kind, value) = match (entry.get::<Vec<u8>>(CHUNK), entry.get::<Vec<u8>>(VERDICT)) {
                    (Some(chunk), _) => (CHUNK, chunk),
                    (None, Some(end)) => (VERDICT, end),
                    // The head (read by `stream_head`), or a field no
                    // release writes: nothing to take.
                    (None, None) => continue,
                };
                let (index, payload) = self
                    .open_record(job, kind, &value)
                    .map_err(|why| self.refuse(why))?;
                if index != chunks {
                    return Err(self.refuse(Rejection::Truncated));
                }
                if kind == VERDICT {
                    return match payload.as_slice() {
                        [committed] => Ok(*committed == 1),
                        _ => Err(self.refuse(Rejection::Malformed)),
                    };
                }
                chunks += 1;
                push(Bytes::from(payload));
            }
            if any {
                quiet_since = tokio::time::Instant::now();
            } else if quiet_since.elapsed() > stall {
                return Err("the mirrored stream went quiet".into());
            }
        }
    }

    /// Counts and logs a part of a mirrored stream not believed, and says
    /// why the copy is completed from the store instead.
    fn refuse(&self, why: Rejection) -> BoxError {
        self.rejected::<()>("stream", why);
        format!("a part of the mirrored stream was not believed ({why})").into()
    }

    /// The record of part `index` of `job`'s stream, of `kind` (`docs/design.md`
    /// §17): `IGS2 | mode 1 | key id 8 | index 8 | payload | trailer`.
    fn record(&self, job: JobId, kind: &str, index: u64, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(FORMAT.len() + HEAD_LEN + 8 + payload.len() + 32);
        out.extend_from_slice(FORMAT);
        out.extend_from_slice(&self.keys.head());
        out.extend_from_slice(&index.to_be_bytes());
        let start = out.len();
        out.extend_from_slice(payload);
        let bound = bound(&out[FORMAT.len()..][..HEAD_LEN], job, kind, index);
        self.keys.protect(bound.bytes(), &mut out, start);
        out
    }

    /// The position and payload of a record of `kind` of `job`'s stream, if
    /// it verifies.
    fn open_record(
        &self,
        job: JobId,
        kind: &str,
        record: &[u8],
    ) -> Result<(u64, Vec<u8>), Rejection> {
        let rest = record.strip_prefix(FORMAT).ok_or(Rejection::Version)?;
        let (head, rest) = rest.split_at_checked(HEAD_LEN).ok_or(Rejection::Malformed)?;
        let reader = self.keys.reader(head)?;
        let (index, protected) = rest.split_at_checked(8).ok_or(Rejection::Malformed)?;
        let index = u64::from_be_bytes(index.try_into().map_err(|_| Rejection::Malformed)?);
        let payload = reader.open(bound(head, job, kind, index).bytes(), protected)?;
        Ok((index, payload.into_owned()))
    }
}

/// What a stream record's tag covers besides its payload.
fn bound(head: &[u8], job: JobId, kind: &str, index: u64) -> Fields {
    let mut fields = Fields::new(FORMAT);
    fields
        .push(head)
        .push(job.0.as_bytes())
        .push(kind.as_bytes())
        .push(&index.to_be_bytes());
    fields
}
