//! The records of a streamed answer mirrored on a Redis Stream, so that
//! duplicates on other replicas join it live ([`FastPath::mirror`] writes
//! them, [`FastPath::feed`] reads them back).
//!
//! Every part of a mirrored stream is a record authenticated as replay
//! entries are (`docs/design.md` §17), bound to its job, its kind and its
//! position: the head is part 0, chunk `i` is chunk `i`, and the end
//! carries the number of chunks before it. So a reader takes chunks only in
//! order and one after another, never another job's, and believes an end
//! only when it counts every chunk it read: a stream cut short, reordered
//! or spliced is never served as complete.

use bytes::Bytes;

use super::keys::{EntryKeys, Fields, Rejection, HEAD_LEN};
use idemgate_domain::id::JobId;

#[cfg(doc)]
use super::FastPath;

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

/// The format of stream records; another is not believed. `IGS2`, before
/// records named their attempt, is not: its stream may be an earlier
/// attempt's.
const FORMAT: &[u8; 4] = b"IGS3";

/// A piece of a streamed answer as it is mirrored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// The next chunk of the body.
    Chunk(Bytes),
    /// The end, and how the stream ended.
    End(Ending),
}

/// How a stream ended: what its readers' bodies do at the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// Committed, the whole answer: the bodies end.
    Committed,
    /// Cut before its end: the bodies fail.
    Cut,
    /// Its end came, but it is not the job's answer (it reported an error
    /// the route retries, `docs/design.md` §10): the bodies end, as the
    /// upstream ended them, and nothing was committed.
    Uncommitted,
}

impl Ending {
    /// Its byte in an end record. A release that knew only the first two
    /// reads any other byte as a cut.
    pub fn byte(self) -> u8 {
        match self {
            Ending::Cut => 0,
            Ending::Committed => 1,
            Ending::Uncommitted => 2,
        }
    }

    /// The ending an end record's byte names.
    pub fn of_byte(byte: u8) -> Option<Ending> {
        match byte {
            0 => Some(Ending::Cut),
            1 => Some(Ending::Committed),
            2 => Some(Ending::Uncommitted),
            _ => None,
        }
    }
}

/// The record of the part at position `index` of the stream of attempt
/// number `attempt` of `job` (`docs/design.md` §17): `IGS3 | mode 1 | key
/// id 8 | index 8 | attempt 4 | payload | trailer`, its tag covering the
/// job, the attempt, the part and the position.
pub fn record(
    keys: &EntryKeys,
    (job, attempt): (JobId, i32),
    part: Part,
    index: u64,
    payload: &[u8],
) -> Vec<u8> {
    let mut out = Vec::with_capacity(FORMAT.len() + HEAD_LEN + 12 + payload.len() + 32);
    out.extend_from_slice(FORMAT);
    out.extend_from_slice(&keys.head());
    out.extend_from_slice(&index.to_be_bytes());
    out.extend_from_slice(&attempt.to_be_bytes());
    let start = out.len();
    out.extend_from_slice(payload);
    let bound = bound(
        &out[FORMAT.len()..][..HEAD_LEN],
        (job, attempt),
        part,
        index,
    );
    keys.protect(bound.bytes(), &mut out, start);
    out
}

/// The attempt a stream record says it is of, unverified: a reader of
/// another attempt's stream passes over it without counting it forged
/// (the stream of a job is rewritten by each attempt that streams).
pub fn record_attempt(record: &[u8]) -> Option<i32> {
    let at = FORMAT.len() + HEAD_LEN + 8;
    let bytes = record.strip_prefix(FORMAT)?.get(at - FORMAT.len()..)?;
    Some(i32::from_be_bytes(bytes.get(..4)?.try_into().ok()?))
}

/// The position and payload of a record found as `part` of the stream of
/// attempt number `attempt` of `job`, if it verifies as one.
pub fn open_record(
    keys: &EntryKeys,
    (job, attempt): (JobId, i32),
    part: Part,
    record: &[u8],
) -> Result<(u64, Vec<u8>), Rejection> {
    let rest = record.strip_prefix(FORMAT).ok_or(Rejection::Version)?;
    let (head, rest) = rest
        .split_at_checked(HEAD_LEN)
        .ok_or(Rejection::Malformed)?;
    let reader = keys.reader(head)?;
    let (index, rest) = rest.split_at_checked(8).ok_or(Rejection::Malformed)?;
    let index = u64::from_be_bytes(index.try_into().map_err(|_| Rejection::Malformed)?);
    // The attempt in the clear is only a hint: the tag covers the one asked for.
    let protected = rest.get(4..).ok_or(Rejection::Malformed)?;
    let payload = reader.open(bound(head, (job, attempt), part, index).bytes(), protected)?;
    Ok((index, payload.into_owned()))
}

/// What a stream record's tag covers besides its payload.
fn bound(head: &[u8], (job, attempt): (JobId, i32), part: Part, index: u64) -> Fields {
    let mut fields = Fields::new(FORMAT);
    fields
        .push(head)
        .push(job.0.as_bytes())
        .push(&attempt.to_be_bytes())
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
            let job = (JobId::new(), 1);
            let chunk = record(&keys, job, Part::Chunk, 3, b"data: 3\n\n");
            assert_eq!(
                open_record(&keys, job, Part::Chunk, &chunk),
                Ok((3, b"data: 3\n\n".to_vec()))
            );
            assert_eq!(
                open_record(&keys, (JobId::new(), 1), Part::Chunk, &chunk),
                Err(Rejection::Forged),
                "another job's chunk"
            );
            assert_eq!(record_attempt(&chunk), Some(1));
            assert_eq!(
                open_record(&keys, (job.0, 2), Part::Chunk, &chunk),
                Err(Rejection::Forged),
                "an earlier attempt's chunk"
            );
            // Its attempt rewritten in the clear: the tag covers it.
            let mut renumbered = chunk.clone();
            renumbered[4 + HEAD_LEN + 8..][..4].copy_from_slice(&2i32.to_be_bytes());
            assert_eq!(record_attempt(&renumbered), Some(2));
            assert_eq!(
                open_record(&keys, (job.0, 2), Part::Chunk, &renumbered),
                Err(Rejection::Forged)
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
