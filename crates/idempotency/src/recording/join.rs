//! Joining a stream while it runs (`docs/design.md` §10): a duplicate of a
//! job whose answer is streaming reads the recording on this replica, or,
//! with Redis, a local copy fed from the Redis Stream another replica
//! mirrors the answer on. One copy per job here, however many duplicates.

use std::sync::Arc;
use std::time::Duration;

use http::Response;
use quick_cache::sync::Cache;

use super::{Recording, Recordings};
use crate::hold::Holds;
use idemgate_domain::id::JobId;
use idemgate_domain::job::{Job, JobState};
use idemgate_proxy::budget::Budget;
use idemgate_proxy::http::Body;
use idemgate_store::fastpath::{Ending, FastPath, MirroredHead, Tag};
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
    /// Attempts the store said had ended, whose mirrored streams are not
    /// joined: an attempt never runs again, so it is asked once.
    ended: Cache<(JobId, i32), ()>,
}

/// How many ended attempts [`Live`] remembers.
const ENDED: usize = 1024;

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
            ended: Cache::new(ENDED),
        }
    }

    /// Makes `recording` joinable until it ends.
    pub(crate) fn insert(&self, recording: &Arc<Recording>) {
        self.recordings.insert(recording);
    }

    /// Whether the job's answer streams here or, with Redis, elsewhere;
    /// `attempt` is the job's latest as its reader last read it (see
    /// [`Live::mirrored_head`]).
    pub(crate) async fn streaming(&self, tag: &Tag, job: JobId, attempt: i32) -> bool {
        if self.recordings.live(job).is_some() {
            return true;
        }
        self.mirrored_head(tag, (job, attempt)).await.is_some()
    }

    /// The head of the stream another replica mirrors for `job`, when it
    /// is the answer a reader whose latest read of the job saw `latest`
    /// attempts should join: the latest attempt's, or an earlier one's
    /// that still runs. A hedge started beside an attempt that then took
    /// its head as a stream is superseded by it, and the streaming attempt
    /// is the job's only answer (`docs/design.md` §10), though not its
    /// latest. An earlier attempt's stream whose attempt has ended (an
    /// answer that failed in-band, left in Redis for the retry that
    /// follows) is not the job's answer: the store says which, asked only
    /// then, and once for each attempt it says has ended.
    async fn mirrored_head(&self, tag: &Tag, (job, latest): (JobId, i32)) -> Option<MirroredHead> {
        let head = self.fastpath.as_ref()?.stream_head(tag, job).await?;
        if head.attempt == latest {
            return Some(head);
        }
        let earlier = (job, head.attempt);
        if head.attempt > latest || self.ended.get(&earlier).is_some() {
            return None;
        }
        match self.holds.attempt_runs(job, head.attempt).await {
            Some(true) => Some(head),
            Some(false) => {
                self.ended.insert(earlier, ());
                None
            }
            None => None,
        }
    }

    /// Joins the answer of `job` while it streams (its latest attempt's, or
    /// an earlier one's that superseded it: [`Live::mirrored_head`]); `None`
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
        (job, latest): (JobId, i32),
    ) -> Option<Arc<Recording>> {
        let fast = self.fastpath.clone()?;
        let head = self.mirrored_head(tag, (job, latest)).await?;
        // Another duplicate here made a copy while this one asked.
        if let Some(copy) = self.recordings.live(job) {
            return Some(copy);
        }
        let attempt = head.attempt;
        // Counted, never refused: its joiners were taken already.
        let recording = Recording::new(job, head.status, head.headers, self.budget.open());
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
                    live.complete_from_store(&tag, &copy, attempt).await;
                }
            }
        });
        Some(recording)
    }

    /// Completes a copy of the stream of attempt number `attempt` from the
    /// job's committed answer, when that attempt committed it (a hedge's
    /// answer is not the rest of another attempt's stream).
    async fn complete_from_store(&self, tag: &Tag, copy: &Recording, attempt: i32) {
        let settled = self
            .holds
            .wait_settled(copy.job(), self.settle, |job, attempt| {
                self.streaming(tag, job, attempt)
            })
            .await;
        // A copy of this stream is already held here: what is left of the
        // answer is read whatever its size.
        let committed = match settled {
            Ok(Some(job))
                if job.state == JobState::Completed
                    && self.holds.committed_by(job.id).await == Some(attempt) =>
            {
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
