//! Joining a stream while it runs (`docs/design.md` §10): a duplicate of a
//! job whose answer is streaming reads the recording on this replica, or,
//! with Redis, a local copy fed from the Redis Stream another replica
//! mirrors the answer on. One copy per job here, however many duplicates.

use std::sync::Arc;
use std::time::Duration;

use http::Response;

use super::{Recording, Recordings};
use crate::hold::Holds;
use idemgate_domain::id::JobId;
use idemgate_domain::job::{Job, JobState};
use idemgate_proxy::budget::Budget;
use idemgate_proxy::http::Body;
use idemgate_store::fastpath::{Ending, FastPath, Tag};
use idemgate_telemetry::Chain;

/// The streams duplicates may join: recorded here, or mirrored elsewhere.
pub(crate) struct Live {
    recordings: Recordings,
    fastpath: Option<Arc<FastPath>>,
    holds: Arc<Holds>,
    /// Silence on a mirrored stream after which its copy here is completed
    /// from the store instead.
    stall: Duration,
    /// How long such a copy waits for the job to settle: as long as its
    /// attempt may still run.
    settle: Duration,
    /// What copies of mirrored streams are held against.
    budget: Arc<Budget>,
}

impl Live {
    /// Streams recorded here, and with `fastpath` mirrored ones; a copy of a
    /// mirrored stream silent for `stall` is completed from the store once
    /// its job settles (`settle` at most). Copies are held against `budget`.
    pub(crate) fn new(
        fastpath: Option<Arc<FastPath>>,
        holds: Arc<Holds>,
        (stall, settle): (Duration, Duration),
        budget: Arc<Budget>,
    ) -> Self {
        Live {
            recordings: Recordings::default(),
            fastpath,
            holds,
            stall,
            settle,
            budget,
        }
    }

    /// Makes `recording` joinable until it ends.
    pub(crate) fn insert(&self, recording: &Arc<Recording>) {
        self.recordings.insert(recording);
    }

    /// Whether the job's answer streams here or, with Redis, elsewhere: the
    /// answer of `attempt`, the job's latest as its reader last read it (a
    /// stream an earlier attempt left in Redis is not this one).
    pub(crate) async fn streaming(&self, tag: &Tag, job: JobId, attempt: i32) -> bool {
        if self.recordings.live(job).is_some() {
            return true;
        }
        match &self.fastpath {
            Some(fast) => fast.stream_head(tag, (job, attempt)).await.is_some(),
            None => false,
        }
    }

    /// Joins the answer of `job`'s latest attempt while it streams; `None`
    /// when it does not.
    pub(crate) async fn join(self: &Arc<Self>, tag: &Tag, job: &Job) -> Option<Response<Body>> {
        let recording = match self.recordings.live(job.id) {
            Some(recording) => recording,
            None => self.mirrored(tag, (job.id, job.attempt_count)).await?,
        };
        metrics::counter!("idemgate_stream_joiners_total").increment(1);
        Some(recording.response(true))
    }

    /// A local recording fed from the Redis Stream another replica mirrors
    /// the job's answer on, shared by every duplicate here. If Redis fails
    /// or the stream stalls, the answer is completed from the store once it
    /// is committed (or cut, if it never is).
    async fn mirrored(
        self: &Arc<Self>,
        tag: &Tag,
        (job, attempt): (JobId, i32),
    ) -> Option<Arc<Recording>> {
        let fast = self.fastpath.clone()?;
        let (status, headers) = fast.stream_head(tag, (job, attempt)).await?;
        // Counted, never refused: its joiners were taken already.
        let recording = Recording::new(job, status, headers, self.budget.open());
        self.recordings.insert(&recording);
        let (live, copy, tag) = (self.clone(), recording.clone(), *tag);
        tokio::spawn(async move {
            match fast
                .feed(&tag, (job, attempt), live.stall, |chunk| copy.push(chunk))
                .await
            {
                Ok(Ending::Committed) => copy.finish(),
                Ok(Ending::Cut) => copy.cut(),
                Ok(Ending::Uncommitted) => copy.end_uncommitted(),
                Err(e) => {
                    tracing::info!(%job, error = %Chain(e.as_ref()), "the mirrored stream failed; completing it from the store");
                    live.complete_from_store(&tag, &copy).await;
                }
            }
        });
        Some(recording)
    }

    /// Completes a copy of a stream from the job's committed answer.
    async fn complete_from_store(&self, tag: &Tag, copy: &Recording) {
        let settled = self
            .holds
            .wait_settled(copy.job(), self.settle, |job, attempt| {
                self.streaming(tag, job, attempt)
            })
            .await;
        // A copy of this stream is already held here: what is left of the
        // answer is read whatever its size.
        let committed = match settled {
            Ok(Some(job)) if job.state == JobState::Completed => {
                self.holds.committed(job).await.ok().flatten()
            }
            _ => None,
        };
        let sent = copy.stored().body;
        match committed {
            Some(answer) if answer.body.starts_with(&sent) => {
                copy.push(answer.body.slice(sent.len()..));
                copy.finish();
            }
            _ => copy.cut(),
        }
    }
}
