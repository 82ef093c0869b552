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
use super::keys::{EntryKeys, Fields, Rejection, HEAD_LEN};
use super::FastPath;
use crate::codec::{decode_headers, encode_headers};
use crate::Doorbell;
use idemgate_domain::id::JobId;
use idemgate_domain::BoxError;

/// The parts of a mirrored stream, each in a Redis Stream entry of its own
/// under a field that names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Status and headers: position 0.
    Head,
    /// The next chunk of the body: chunk `i` at position `i`.
    Chunk,
    /// The verdict, at the position of the number of chunks before it.
    End,
}

impl Part {
    /// The Redis Stream field it is written under, which its tag covers.
    pub fn field(self) -> &'static str {
        match self {
            Part::Head => "h",
            Part::Chunk => "c",
            Part::End => "e",
        }
    }
}

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
                .arg(Part::Head.field())
                .arg(record(&fast.keys, job, Part::Head, 0, &head))
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
                let (part, index, value) = match piece {
                    Piece::Chunk(chunk) => {
                        chunks += 1;
                        (Part::Chunk, chunks - 1, chunk)
                    }
                    // The end counts the chunks before it.
                    Piece::End { committed } => {
                        (Part::End, chunks, Bytes::from(vec![committed as u8]))
                    }
                };
                let (field, value) = (part.field(), record(&fast.keys, job, part, index, &value));
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
        let found = entry.get::<Vec<u8>>(Part::Head.field())?;
        let head = match open_record(&self.keys, job, Part::Head, &found) {
            Ok((0, head)) => head,
            Ok(_) => return self.rejected("mirrored stream part", Rejection::Truncated),
            Err(why) => return self.rejected("mirrored stream part", why),
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
                let (part, value) = match (
                    entry.get::<Vec<u8>>(Part::Chunk.field()),
                    entry.get::<Vec<u8>>(Part::End.field()),
                ) {
                    (Some(chunk), _) => (Part::Chunk, chunk),
                    (None, Some(end)) => (Part::End, end),
                    // The head (read by `stream_head`), or a field no
                    // release writes: nothing to take.
                    (None, None) => continue,
                };
                let (index, payload) =
                    open_record(&self.keys, job, part, &value).map_err(|why| self.refuse(why))?;
                if index != chunks {
                    return Err(self.refuse(Rejection::Truncated));
                }
                if part == Part::End {
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
        self.rejected::<()>("mirrored stream part", why);
        format!("a part of the mirrored stream was not believed ({why})").into()
    }
}

/// The record of the part at position `index` of `job`'s stream
/// (`docs/design.md` §17): `IGS2 | mode 1 | key id 8 | index 8 | payload |
/// trailer`, its tag covering the job, the part and the position.
pub fn record(keys: &EntryKeys, job: JobId, part: Part, index: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(FORMAT.len() + HEAD_LEN + 8 + payload.len() + 32);
    out.extend_from_slice(FORMAT);
    out.extend_from_slice(&keys.head());
    out.extend_from_slice(&index.to_be_bytes());
    let start = out.len();
    out.extend_from_slice(payload);
    let bound = bound(&out[FORMAT.len()..][..HEAD_LEN], job, part, index);
    keys.protect(bound.bytes(), &mut out, start);
    out
}

/// The position and payload of a record found as `part` of `job`'s
/// stream, if it verifies as one.
pub fn open_record(
    keys: &EntryKeys,
    job: JobId,
    part: Part,
    record: &[u8],
) -> Result<(u64, Vec<u8>), Rejection> {
    let rest = record.strip_prefix(FORMAT).ok_or(Rejection::Version)?;
    let (head, rest) = rest
        .split_at_checked(HEAD_LEN)
        .ok_or(Rejection::Malformed)?;
    let reader = keys.reader(head)?;
    let (index, protected) = rest.split_at_checked(8).ok_or(Rejection::Malformed)?;
    let index = u64::from_be_bytes(index.try_into().map_err(|_| Rejection::Malformed)?);
    let payload = reader.open(bound(head, job, part, index).bytes(), protected)?;
    Ok((index, payload.into_owned()))
}

/// What a stream record's tag covers besides its payload.
fn bound(head: &[u8], job: JobId, part: Part, index: u64) -> Fields {
    let mut fields = Fields::new(FORMAT);
    fields
        .push(head)
        .push(job.0.as_bytes())
        .push(part.field().as_bytes())
        .push(&index.to_be_bytes());
    fields
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_opens_only_as_the_part_of_the_job_it_was_written_as() {
        for sealed in [false, true] {
            let keys = EntryKeys::new(&[5; 32], [], sealed);
            let job = JobId::new();
            let chunk = record(&keys, job, Part::Chunk, 3, b"data: 3\n\n");
            assert_eq!(
                open_record(&keys, job, Part::Chunk, &chunk),
                Ok((3, b"data: 3\n\n".to_vec()))
            );
            assert_eq!(
                open_record(&keys, JobId::new(), Part::Chunk, &chunk),
                Err(Rejection::Forged),
                "another job's chunk"
            );
            assert_eq!(
                open_record(&keys, job, Part::End, &chunk),
                Err(Rejection::Forged),
                "a chunk passed off as the end"
            );
            // Its position moved: the tag covers it.
            let mut moved = chunk.clone();
            moved[4 + HEAD_LEN..][..8].copy_from_slice(&4u64.to_be_bytes());
            assert_eq!(
                open_record(&keys, job, Part::Chunk, &moved),
                Err(Rejection::Forged)
            );
            let end = record(&keys, job, Part::End, 4, &[1]);
            let mut recounted = end.clone();
            recounted[4 + HEAD_LEN..][..8].copy_from_slice(&2u64.to_be_bytes());
            assert_eq!(
                open_record(&keys, job, Part::End, &recounted),
                Err(Rejection::Forged)
            );
            assert_eq!(
                open_record(&keys, job, Part::End, b"committed"),
                Err(Rejection::Version)
            );
        }
    }
}
