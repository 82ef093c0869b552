//! Streamed answers mirrored on Redis Streams, so that duplicates on other
//! replicas join them live.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};

use super::entry::{stream_key, Tag};
use super::FastPath;
use crate::domain::id::JobId;
use crate::store::codec::{decode_headers, encode_headers};
use crate::store::Doorbell;
use crate::BoxError;

/// Stream entry fields: the head, a chunk, the verdict.
const HEAD: &str = "h";
const CHUNK: &str = "c";
const VERDICT: &str = "e";

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
                .arg(fast.seal_bytes(job, &head))
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
            while let Some(piece) = pieces.next().await {
                let (field, value) = match piece {
                    Piece::Chunk(chunk) => (CHUNK, fast.seal_bytes(job, &chunk)),
                    Piece::End { committed } => (VERDICT, verdict(committed).as_bytes().to_vec()),
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
        let head = self.open_bytes(job, &entry.get::<Vec<u8>>(HEAD)?)?;
        let (status, headers) = head.split_at_checked(2)?;
        Some((
            u16::from_be_bytes(status.try_into().ok()?),
            decode_headers(headers)?,
        ))
    }

    /// Hands each chunk of the Redis Stream `job`'s answer is mirrored on to
    /// `push`, from the start, until the verdict: whether the answer was
    /// committed. Fails when Redis fails or nothing arrives for `stall` (the
    /// replica recording it may have died): the caller then completes the
    /// answer from the store.
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
                if let Some(chunk) = entry.get::<Vec<u8>>(CHUNK) {
                    let chunk = self
                        .open_bytes(job, &chunk)
                        .ok_or("a mirrored chunk does not open")?;
                    push(Bytes::from(chunk));
                } else if let Some(end) = entry.get::<String>(VERDICT) {
                    return Ok(end == verdict(true));
                }
            }
            if any {
                quiet_since = tokio::time::Instant::now();
            } else if quiet_since.elapsed() > stall {
                return Err("the mirrored stream went quiet".into());
            }
        }
    }

    fn seal_bytes(&self, job: JobId, plain: &[u8]) -> Vec<u8> {
        match &self.sealer {
            Some(sealer) => {
                let mut sealed = vec![sealer.active().len() as u8];
                sealed.extend_from_slice(sealer.active().as_bytes());
                sealed.extend_from_slice(&sealer.seal_bytes(job, plain));
                sealed
            }
            None => plain.to_vec(),
        }
    }

    fn open_bytes(&self, job: JobId, value: &[u8]) -> Option<Vec<u8>> {
        match &self.sealer {
            Some(sealer) => {
                let (&len, rest) = value.split_first()?;
                let (key, sealed) = rest.split_at_checked(len as usize)?;
                sealer
                    .open_bytes(std::str::from_utf8(key).ok()?, job, sealed)
                    .ok()
            }
            None => Some(value.to_vec()),
        }
    }
}

fn verdict(committed: bool) -> &'static str {
    if committed {
        "committed"
    } else {
        "cut"
    }
}
