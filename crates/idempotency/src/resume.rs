//! Resuming a stream where its client lost it (`docs/design.md` §10,
//! "Resume"): a retry that names a resume point (`Last-Event-ID`, or the
//! count of events it has in `Idempotency-Events-Received`) gets only what
//! follows that point, byte for byte as the first client got it.
//!
//! Applied to whatever answers the retry as a replay, so it works the same
//! from every source: the replay cache, Redis, the store, a stream still
//! being recorded here, or one mirrored from another replica. The head is
//! sent only once the point is reached: a stream still running is waited
//! for, and a point the whole answer never reaches is refused with `416`,
//! nothing replayed.

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderValue, Response};
use http_body::Frame;
use http_body_util::{BodyExt, BodyStream, StreamBody};

use crate::error::ClientError;
use crate::recording::is_event_stream_head;
use idemgate_domain::sse::{ResumePoint, Skip, Skipped};
use idemgate_proxy::http::{Body, BodyError, EVENTS_SKIPPED};

/// The part of `replay` (an answer of the job, replayed or joined) after
/// `point`; `416` when it is not an event stream or never reaches it, and
/// `409` (retry after `retry_after`) when it was cut before the point: its
/// outcome is unknown.
pub(crate) async fn resume(
    replay: Response<Body>,
    point: &ResumePoint,
    retry_after: Duration,
) -> Result<Response<Body>, ClientError> {
    if !is_event_stream_head(replay.headers()) {
        return Err(unsatisfiable(
            "the job's answer is not an event stream (or is a compressed one), so there is \
             nothing to resume; send the request without Last-Event-ID or \
             Idempotency-Events-Received to get it whole",
            None,
        ));
    }
    let (mut parts, body) = replay.into_parts();
    let mut skip = Skip::new(point.clone());
    let mut frames = BodyStream::new(body);
    let after = if skip.reached() {
        Bytes::new()
    } else {
        loop {
            match frames.next().await {
                Some(Ok(frame)) => {
                    let Ok(data) = frame.into_data() else {
                        continue;
                    };
                    if let Skipped::Reached(after) = skip.push(&data) {
                        break after;
                    }
                }
                // Cut before the point: as for any retry of a job whose
                // attempt was cut.
                Some(Err(_)) => return Err(ClientError::OutcomeUnknown { retry_after }),
                None => return Err(past_the_end(point, skip.skipped())),
            }
        }
    };
    metrics::counter!("idemgate_stream_resumes_total", "result" => "resumed").increment(1);
    // The body is shorter now: whatever length was set is not its own.
    parts.headers.remove(http::header::CONTENT_LENGTH);
    parts
        .headers
        .insert(EVENTS_SKIPPED, HeaderValue::from(skip.skipped()));
    let first = futures_util::stream::once(async move { Ok::<_, BodyError>(Frame::data(after)) });
    let rest = without_leading_lf(frames, skip.drops_lf());
    Ok(Response::from_parts(
        parts,
        BodyExt::boxed(StreamBody::new(first.chain(rest))),
    ))
}

/// `frames`, an LF first in them dropped when `drop` says it is still the
/// point's event's (the rest of its CRLF, cut after its CR).
fn without_leading_lf(
    frames: BodyStream<Body>,
    mut drop: bool,
) -> impl futures_util::Stream<Item = Result<Frame<Bytes>, BodyError>> {
    frames.map(move |frame| {
        let frame = frame?;
        if !drop {
            return Ok(frame);
        }
        match frame.into_data() {
            Ok(data) if data.is_empty() => Ok(Frame::data(data)),
            Ok(data) => {
                drop = false;
                let lf = usize::from(data[0] == b'\n');
                Ok(Frame::data(data.slice(lf..)))
            }
            Err(frame) => Ok(frame),
        }
    })
}

/// Why a point the whole answer never reaches is refused.
fn past_the_end(point: &ResumePoint, events: usize) -> ClientError {
    let why = match point {
        ResumePoint::After(n) => format!(
            "Idempotency-Events-Received is {n}, but the answer has {events} events; \
             send the number of events you received (0 to {events})"
        ),
        ResumePoint::AfterId(id) => format!(
            "no event of the answer has the id {id:?} (Last-Event-ID); send the id of \
             the last event you received"
        ),
    };
    unsatisfiable(&why, Some(events))
}

fn unsatisfiable(why: &str, events: Option<usize>) -> ClientError {
    metrics::counter!("idemgate_stream_resumes_total", "result" => "refused").increment(1);
    ClientError::ResumeUnsatisfiable {
        why: why.to_owned(),
        events,
    }
}
