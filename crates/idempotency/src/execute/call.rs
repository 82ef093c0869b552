//! The upstream call of one attempt, watched (`docs/design.md` §5, §10,
//! §11): silence past `first_byte_timeout` before the answer's head, or past
//! `stream_idle_timeout` between body chunks, makes the attempt `unknown` at
//! once and tells the request so, while the call goes on until the
//! attempt's deadline and may still commit; cancelled because another
//! attempt won, the call is dropped. A streamed answer is relayed into its
//! recording as it comes, and its end released only once committed; one
//! that goes silent is cut.

use std::sync::Arc;
use std::time::Duration;

use http::Request;
use http_body_util::BodyExt;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::record::outcome;
use super::{Reply, Task, UpstreamService};
use crate::recording::Recording;
use crate::replay;
use crate::route::Silences;
use idemgate_domain::attempt::{AttemptFailure, AttemptState};
use idemgate_domain::contract::excerpt;
use idemgate_proxy::http::Body;
use idemgate_proxy::upstream::{self, Fetched, UpstreamError};
use idemgate_store::CommitOutcome;
use idemgate_telemetry::Chain;

/// How the upstream call ended.
pub(super) enum Call {
    Answered(Result<Fetched, UpstreamError>),
    /// The head of an answer the route streams; its body is still coming.
    Streaming(http::response::Parts, Body),
    Cancelled,
    DeadlinePassed,
}

/// How a watched piece of the call ended.
enum Watched<T> {
    Done(T),
    Cancelled,
    DeadlinePassed,
}

/// How relaying a streamed body ended.
enum Relayed {
    /// The upstream ended it.
    Ended,
    /// Cut short: what happened.
    Broke(String),
    /// Another attempt won.
    Cancelled,
}

/// The silence timer of one call, across its head and its body: the
/// first byte's allowance until the head comes, the idle one after.
struct Clock {
    silence: std::pin::Pin<Box<tokio::time::Sleep>>,
    silences: Silences,
    /// Whether the answer's head has come.
    head_came: bool,
    timed_out: bool,
}

impl Clock {
    fn new(silences: Silences) -> Clock {
        Clock {
            silence: Box::pin(tokio::time::sleep(silences.first_byte)),
            silences,
            head_came: false,
            timed_out: false,
        }
    }

    /// The silence allowed now.
    fn allowed(&self) -> Duration {
        if self.head_came {
            self.silences.stream_idle
        } else {
            self.silences.first_byte
        }
    }

    /// The head came: from now on the body's chunks are timed.
    fn took_head(&mut self) {
        self.head_came = true;
        self.restart();
    }

    /// Something came: the allowance starts over.
    fn restart(&mut self) {
        let at = Instant::now() + self.allowed();
        self.silence.as_mut().reset(at);
    }

    /// What the silence that fired is recorded as, naming its key.
    fn detail(&self) -> String {
        let allowed = humantime::format_duration(self.allowed());
        if self.head_came {
            format!("the answer's body went silent for {allowed} (stream_idle_timeout)")
        } else {
            format!("no answer head within {allowed} (first_byte_timeout)")
        }
    }
}

impl Task {
    /// Sends the request and waits for the answer's head, then for its
    /// whole body, unless the route streams it; all the while watching for
    /// silence (then `unknown` at once, the call going on), cancellation and
    /// the attempt's deadline.
    pub(super) async fn call(
        &mut self,
        upstream: UpstreamService,
        request: Request<Body>,
        cancel: &CancellationToken,
    ) -> Call {
        use tower::ServiceExt;
        let (progress_tx, mut progress) = watch::channel(0u64);
        let mut clock = Clock::new(self.silences);
        let head = async {
            let head = upstream.oneshot(request).await;
            progress_tx.send_modify(|n| *n += 1);
            head
        };
        let response = match self.watch(head, &mut progress, &mut clock, cancel).await {
            Watched::Done(Ok(response)) => response,
            Watched::Done(Err(e)) => return Call::Answered(Err(e)),
            Watched::Cancelled => return Call::Cancelled,
            Watched::DeadlinePassed => return Call::DeadlinePassed,
        };
        let (parts, body) = response.into_parts();
        if !clock.timed_out {
            clock.took_head();
        }
        // A stream whose first client was already told "unknown" is read
        // whole like any late answer.
        let retryable = self
            .route
            .retryable_statuses
            .contains(&parts.status.as_u16());
        if !clock.timed_out && !retryable && self.route.streams(&parts.headers) {
            return Call::Streaming(parts, body);
        }
        let limit = self.runner.config.max_response_size;
        let charge = self.charge.clone();
        let rest = upstream::read_body(parts, body, limit, &progress_tx, Some(&charge));
        match self.watch(rest, &mut progress, &mut clock, cancel).await {
            Watched::Done(result) => Call::Answered(result),
            Watched::Cancelled => Call::Cancelled,
            Watched::DeadlinePassed => Call::DeadlinePassed,
        }
    }

    /// Runs `work` while watching the clock: silence past what it allows
    /// records the attempt `unknown` and tells the request (the work goes
    /// on); cancellation and the deadline stop it.
    async fn watch<T>(
        &mut self,
        work: impl std::future::Future<Output = T>,
        progress: &mut watch::Receiver<u64>,
        clock: &mut Clock,
        cancel: &CancellationToken,
    ) -> Watched<T> {
        tokio::pin!(work);
        let mut live = true;
        loop {
            tokio::select! {
                done = &mut work => return Watched::Done(done),
                changed = progress.changed(), if live && !clock.timed_out => match changed {
                    Ok(()) => clock.restart(),
                    Err(_) => live = false,
                },
                () = &mut clock.silence, if !clock.timed_out => {
                    clock.timed_out = true;
                    let failure = AttemptFailure::Unknown { detail: clock.detail() };
                    // The job is unknown before anyone is told so; the call
                    // goes on, and its late answer may still settle or
                    // commit the attempt.
                    self.record(failure).await;
                    self.send(Reply::Unknown(UpstreamError::TimedOut(clock.allowed()).into()));
                }
                () = cancel.cancelled() => return Watched::Cancelled,
                () = tokio::time::sleep_until(self.deadline) => return Watched::DeadlinePassed,
            }
        }
    }

    /// Streams the answer through its recording: every client of the job
    /// reads it as it comes; the end is released once it is committed. A
    /// stream cut before its end is `unknown` (the upstream acted) and every
    /// reader's body fails.
    pub(super) async fn stream(
        &mut self,
        parts: http::response::Parts,
        body: Body,
        cancel: &CancellationToken,
    ) {
        let recording = self.open_recording(&parts);
        self.send(Reply::Streaming(recording.clone()));
        match self.relay(body, &recording, cancel).await {
            Relayed::Ended => self.settle_stream(&recording).await,
            // Recorded before any reader hears of the cut, like any outcome.
            Relayed::Broke(detail) => {
                self.record(AttemptFailure::Unknown { detail }).await;
                recording.cut();
            }
            Relayed::Cancelled => {
                let detail = "cancelled: another attempt of the job won".into();
                self.record(AttemptFailure::Superseded { detail }).await;
                recording.cut();
            }
        }
    }

    /// The answer's recording, joinable at once: duplicates held on the job
    /// here look again, and join; with Redis, the stream is mirrored there
    /// and other replicas are told once its head is.
    fn open_recording(&self, parts: &http::response::Parts) -> Arc<Recording> {
        let job = self.attempt.job_id;
        let headers = replay::capture_headers(&parts.headers);
        let status = parts.status.as_u16();
        let recording = Recording::new(job, status, headers.clone(), self.charge.clone());
        self.runner.live.insert(&recording);
        self.runner.doorbell.ring_local(job);
        if let (Some(fast), Some(tag)) = (&self.runner.fastpath, &self.tag) {
            let ttl = self.runner.config.deadline + Duration::from_secs(60);
            let doorbell = self.runner.doorbell.clone();
            let head = (parts.status.as_u16(), &headers[..]);
            fast.mirror(tag, job, head, recording.follow(), ttl, doorbell);
        }
        recording
    }

    /// Copies the upstream's body into `recording` until it ends, breaks,
    /// goes silent past `stream_idle_timeout` (a pause between tokens may
    /// be long, but not endless: `docs/design.md` §10), outgrows what can
    /// be recorded, or the attempt is cancelled or out of time.
    async fn relay(
        &self,
        mut body: Body,
        recording: &Recording,
        cancel: &CancellationToken,
    ) -> Relayed {
        let limit = self.runner.config.max_response_size;
        let idle = self.silences.stream_idle;
        let silence = tokio::time::sleep(idle);
        tokio::pin!(silence);
        let mut received = 0usize;
        loop {
            tokio::select! {
                frame = body.frame() => match frame {
                    None => return Relayed::Ended,
                    Some(Ok(frame)) => {
                        let Ok(data) = frame.into_data() else { continue };
                        received += data.len();
                        if received > limit {
                            return Relayed::Broke(format!("the stream grew past {limit} bytes and cannot be recorded"));
                        }
                        recording.push(data);
                        silence.as_mut().reset(Instant::now() + idle);
                    }
                    Some(Err(e)) => return Relayed::Broke(format!("the stream broke after {received} bytes: {}", Chain(&e))),
                },
                () = &mut silence => {
                    let idle = humantime::format_duration(idle);
                    return Relayed::Broke(format!("the stream went silent for {idle} (stream_idle_timeout)"));
                }
                () = cancel.cancelled() => return Relayed::Cancelled,
                () = tokio::time::sleep_until(self.deadline) => return Relayed::Broke("attempt deadline passed mid-stream".to_owned()),
            }
        }
    }

    /// A whole stream: checked against the contract's events, then
    /// committed; only the commit releases its end to the readers. A breach
    /// is a safe failure, and every copy is cut.
    async fn settle_stream(&self, recording: &Recording) {
        let stored = recording.stored();
        // The whole answer, copied out of the chunks for the commit.
        self.charge.add(stored.body.len());
        if let Some(contract) = &self.route.contract {
            if let Some(Err(why)) = contract.check_stream(&stored.body) {
                metrics::counter!("idemgate_attempts_rejected_total").increment(1);
                let detail = format!(
                    "broke contract {}: {why}; answer: {}",
                    contract.name,
                    excerpt(&stored.body)
                );
                let status = stored.status;
                self.record(AttemptFailure::Rejected { status, detail })
                    .await;
                recording.cut();
                return;
            }
        }
        // Retried as long as the attempt lives.
        match self.write_commit(stored).await {
            Ok(CommitOutcome::Committed) => {
                metrics::counter!("idemgate_commits_total").increment(1);
                outcome(AttemptState::Succeeded);
                recording.finish();
            }
            Ok(CommitOutcome::Superseded) => {
                metrics::counter!("idemgate_commits_superseded_total").increment(1);
                outcome(AttemptState::Superseded);
                recording.cut();
            }
            Err(_) => recording.cut(),
        }
    }
}
