//! Reading whole request bodies: bounded by a limit, and for keyed requests
//! counted against the memory budget as they grow (`docs/design.md` §18).

use bytes::{Bytes, BytesMut};
use http_body_util::{BodyExt, Limited};

use super::{Body, BoxError};
use crate::budget::Charge;

/// Why a body could not be collected.
#[derive(Debug, thiserror::Error)]
pub enum CollectError {
    /// It was larger than allowed.
    #[error("body larger than {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// Holding more of it would take the gateway past its memory budget.
    #[error("the memory budget has no room for the rest of the body")]
    OverBudget,
    /// The peer failed while sending it (or paused past the body-read
    /// timeout: [`BodyTimedOut`](super::idle::BodyTimedOut) in its sources).
    #[error("body could not be read: {0}")]
    Read(BoxError),
}

/// Reads a whole body, refusing it as soon as it passes `limit` bytes (a
/// declared length past the limit is refused before reading anything).
pub async fn collect_limited<B>(body: B, limit: usize) -> Result<Bytes, CollectError>
where
    B: http_body::Body<Data = Bytes> + Send,
    B::Error: Into<BoxError>,
{
    if body.size_hint().lower() > limit as u64 {
        return Err(CollectError::TooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(CollectError::TooLarge { limit })
        }
        Err(e) => Err(CollectError::Read(e)),
    }
}

/// The most of a declared length a keyed request is admitted with
/// before any of its body arrives (`docs/design.md` §18, "Taken as it
/// arrives"): a length costs nothing to declare, and reserving it whole
/// let connections that sent nothing hold the budget.
pub const TAKEN_AHEAD: usize = 64 << 10;

/// Reads a keyed request's whole body, at most `limit` bytes, into one
/// buffer: started at its declared length up to [`TAKEN_AHEAD`] (what
/// `charge` was admitted with), then, once more comes, its whole declared
/// length (a body without one doubles as it comes), each growth taken
/// from the budget first (`OverBudget` when there is no room). Pieces are copied as they arrive
/// and dropped, so a body is held once, never twice. What is left of a
/// refused body stays in `body`, read after the refusal is answered
/// ([`super::linger`]).
pub async fn collect_charged(
    body: &mut Body,
    limit: usize,
    charge: &Charge,
) -> Result<Bytes, CollectError> {
    let hint = http_body::Body::size_hint(&*body);
    if hint.lower() > limit as u64 {
        return Err(CollectError::TooLarge { limit });
    }
    let declared = hint.exact().map_or(0, |n| n as usize);
    let mut buf = BytesMut::with_capacity(declared.min(TAKEN_AHEAD));
    // The admission took that much (one byte at least).
    let mut charged = declared.clamp(1, TAKEN_AHEAD);
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| CollectError::Read(Box::new(e)))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let needed = buf.len() + data.len();
        if needed > limit {
            return Err(CollectError::TooLarge { limit });
        }
        if needed > buf.capacity() {
            // A body past what was taken ahead has shown it comes: its
            // whole declared length now, in one buffer of that size (a
            // buffer grown by steps left the allocator holding each step:
            // 120 MiB more resident under sixty 10 MiB uploads). One
            // without a length doubles. Counted before it is allocated;
            // the buffer it replaces (64 KiB, or half the new one) only
            // for as long as the copy, as any growth was: counted beside
            // it, a body within 64 KiB of the room could never fit.
            let wanted = if declared >= needed {
                declared
            } else {
                needed.max(buf.capacity() * 2).min(limit)
            };
            if wanted > charged && !charge.try_add(wanted - charged) {
                return Err(CollectError::OverBudget);
            }
            charged = charged.max(wanted);
            let mut grown = BytesMut::with_capacity(wanted);
            grown.extend_from_slice(&buf);
            buf = grown;
        }
        buf.extend_from_slice(&data);
    }
    Ok(buf.freeze())
}

#[cfg(test)]
mod tests {
    use http_body_util::StreamBody;

    use super::*;
    use crate::budget::Budget;
    use crate::http::BodyError;

    /// `body`, declaring a length of `.1`.
    struct WithLength<B>(B, u64);

    impl<B: http_body::Body + Unpin> http_body::Body for WithLength<B> {
        type Data = B::Data;
        type Error = B::Error;

        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
            std::pin::Pin::new(&mut self.0).poll_frame(cx)
        }

        fn size_hint(&self) -> http_body::SizeHint {
            http_body::SizeHint::with_exact(self.1)
        }
    }

    /// A body of `pieces`, with no declared length.
    fn chunked(pieces: Vec<&'static [u8]>) -> Body {
        let frames = pieces
            .into_iter()
            .map(|p| Ok::<_, BodyError>(http_body::Frame::data(Bytes::from_static(p))));
        StreamBody::new(futures_util::stream::iter(frames)).boxed()
    }

    #[tokio::test]
    async fn a_declared_body_is_read_into_the_buffer_it_was_admitted_for() {
        let budget = Budget::new(1000);
        let mut body = crate::http::full(vec![7u8; 600]);
        let charge = budget.admit(600).unwrap();
        let read = collect_charged(&mut body, 1000, &charge).await.unwrap();
        assert_eq!(read.len(), 600);
        assert_eq!(charge.bytes(), 600, "no more than the declared length");
    }

    #[tokio::test]
    async fn a_body_without_a_length_is_charged_as_it_grows_and_refused_past_the_budget() {
        let budget = Budget::new(1000);
        let charge = budget.admit(0).unwrap();
        let mut body = chunked(vec![&[1; 100], &[2; 100]]);
        let read = collect_charged(&mut body, 10_000, &charge).await.unwrap();
        assert_eq!(read.len(), 200);
        assert!(charge.bytes() >= 200, "{}", charge.bytes());
        let other = budget.admit(0).unwrap();
        let mut big = chunked(vec![&[1; 500], &[2; 500], &[3; 500]]);
        let refused = collect_charged(&mut big, 10_000, &other).await;
        assert!(matches!(refused, Err(CollectError::OverBudget)));
        drop((charge, other));
        assert_eq!(budget.in_use(), 0, "everything given back");
    }

    /// A declared length is taken ahead only up to [`TAKEN_AHEAD`]: a body
    /// that declares 1 MiB holds 64 KiB until more of it comes, then its
    /// length, never more.
    #[tokio::test]
    async fn a_declared_body_past_what_is_taken_ahead_is_charged_as_it_arrives() {
        let budget = Budget::new(4 << 20);
        let charge = budget.admit(TAKEN_AHEAD).unwrap();
        let (sender, mut receiver) = tokio::sync::mpsc::channel::<Bytes>(1);
        let frames = futures_util::stream::poll_fn(move |cx| receiver.poll_recv(cx));
        let frames =
            futures_util::StreamExt::map(frames, |b| Ok::<_, BodyError>(http_body::Frame::data(b)));
        let mut body = WithLength(StreamBody::new(frames), 1 << 20).boxed();
        let reading = tokio::spawn(async move {
            let read = collect_charged(&mut body, 2 << 20, &charge).await;
            (read, charge)
        });
        sender.send(Bytes::from(vec![1u8; 32 << 10])).await.unwrap();
        tokio::task::yield_now().await;
        assert_eq!(budget.in_use(), TAKEN_AHEAD, "nothing past what came");
        for _ in 0..31 {
            sender.send(Bytes::from(vec![2u8; 32 << 10])).await.unwrap();
        }
        drop(sender);
        let (read, charge) = reading.await.unwrap();
        assert_eq!(read.unwrap().len(), 1 << 20);
        assert_eq!(charge.bytes(), 1 << 20, "its length, not past it");
    }

    /// A body as large as the whole budget fits an idle gateway, declared
    /// or not: the buffer a growth replaces is not counted beside it.
    #[tokio::test]
    async fn a_body_as_large_as_the_budget_fits_an_idle_gateway() {
        let budget = Budget::new(1 << 20);
        let charge = budget.admit(TAKEN_AHEAD).unwrap();
        let mut body = crate::http::full(vec![7u8; 1 << 20]);
        let read = collect_charged(&mut body, 1 << 20, &charge).await.unwrap();
        assert_eq!(read.len(), 1 << 20);
        drop(charge);
        let charge = budget.admit(0).unwrap();
        let pieces: Vec<&'static [u8]> = vec![&[1; 300 << 10], &[2; 300 << 10], &[3; 300 << 10]];
        let read = collect_charged(&mut chunked(pieces), 1 << 20, &charge).await;
        assert_eq!(read.unwrap().len(), 900 << 10);
    }

    #[tokio::test]
    async fn a_body_past_the_limit_is_too_large() {
        let budget = Budget::new(1000);
        let charge = budget.admit(0).unwrap();
        let mut body = chunked(vec![&[1; 60], &[2; 60]]);
        let refused = collect_charged(&mut body, 100, &charge).await;
        assert!(matches!(
            refused,
            Err(CollectError::TooLarge { limit: 100 })
        ));
    }
}
