//! The in-memory backend: the reference the database backends are held to.
//!
//! Nothing survives the process, so the gateway never runs on it; it exists
//! so the dispatch logic can be unit-tested without sockets, and so the
//! conformance suite and the property tests have a plain implementation of
//! [`Backend`] to compare the databases with. Every method takes one lock,
//! which makes each trivially atomic.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;

use super::{
    commit_under_lock, expire_each, Applied, Backend, Begin, Committed, Cursor, Decide, Lock,
    Records, StoreError,
};
use idemgate_domain::attempt::{Attempt, AttemptState, NewAttempt, ResolvedBy};
use idemgate_domain::id::{AttemptId, JobId};
use idemgate_domain::job::{Job, JobDetail, JobState, NewJob};
use idemgate_domain::key::{IdempotencyKey, Owner};
use idemgate_domain::reconcile::{Lookup, Lookups};
use idemgate_domain::response::StoredResponse;
use idemgate_domain::transition::{AttemptHead, Change, JobHead, Refusal, Snapshot};

/// Jobs and attempts in a map.
#[derive(Debug, Default)]
pub struct Memory {
    records: Mutex<Tables>,
}

#[derive(Debug, Default)]
struct Tables {
    jobs: HashMap<JobId, Entry>,
    keys: HashMap<(Owner, IdempotencyKey), JobId>,
    attempts: HashMap<AttemptId, JobId>,
}

#[derive(Debug, Clone)]
struct Entry {
    job: Job,
    attempts: Vec<Attempt>,
    /// Each attempt's deadline, in the order of `attempts`.
    deadlines: Vec<SystemTime>,
    /// When the job last changed, as the database stores' `updated_at`.
    changed_at: SystemTime,
}

impl Memory {
    fn records(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Entry {
    fn snapshot(&self) -> Snapshot {
        Snapshot {
            job: JobHead::of(&self.job),
            attempts: self.attempts.iter().map(AttemptHead::of).collect(),
        }
    }

    /// Whether the job is past its expiry and forgotten: none of its
    /// attempts may still answer and it has not changed for
    /// [`SETTLED_GRACE`](crate::SETTLED_GRACE), as in the database stores
    /// (`docs/design.md` §11, "not forgotten").
    fn forgotten(&self, now: SystemTime) -> bool {
        let answering = |(a, deadline): (&Attempt, &SystemTime)| match a.state {
            AttemptState::Started => true,
            AttemptState::Unknown => *deadline > now,
            _ => false,
        };
        let settled = self.changed_at + crate::SETTLED_GRACE <= now;
        self.job.expires_at <= now
            && settled
            && !self.attempts.iter().zip(&self.deadlines).any(answering)
    }

    fn detail(&self) -> JobDetail {
        JobDetail {
            job: self.job.clone(),
            attempts: self.attempts.clone(),
        }
    }

    /// Writes a change, as the database backends do in SQL.
    fn apply(&mut self, change: &Change, now: SystemTime) -> Option<Attempt> {
        self.changed_at = now;
        let job = &mut self.job;
        job.state = change.job.state;
        job.version = change.job.version;
        job.attempt_count = change.job.attempt_count;
        job.completed_by = change.job.completed_by;
        if let Some(response) = &change.response {
            job.response = Some(response.clone());
        }
        for settled in &change.settled {
            if let Some(a) = self.attempts.iter_mut().find(|a| a.id == settled.attempt) {
                a.state = settled.state;
                if settled.finishes() {
                    a.finished_at = Some(now);
                }
                a.upstream_status = settled.status.or(a.upstream_status);
                a.detail = settled.detail.clone().or(a.detail.take());
                if let Some(operator) = &settled.resolved_by {
                    a.resolved_by = Some(Box::new(ResolvedBy {
                        operator: operator.clone(),
                        at: now,
                    }));
                }
            }
        }
        let start = change.started.as_ref()?;
        let attempt = new_attempt(job.id, start.number, start.job_version, &start.attempt, now);
        self.attempts.push(attempt.clone());
        self.deadlines.push(now + start.attempt.deadline);
        Some(attempt)
    }
}

fn new_attempt(
    job: JobId,
    number: i32,
    job_version: i64,
    new: &NewAttempt,
    now: SystemTime,
) -> Attempt {
    Attempt {
        id: new.id,
        job_id: job,
        number,
        upstream: new.upstream.clone(),
        state: AttemptState::Started,
        job_version,
        started_at: now,
        finished_at: None,
        lease_expires_at: now + new.lease,
        deadline_at: now + new.deadline,
        upstream_status: None,
        detail: None,
        lookups: Lookups::default(),
        resolved_by: None,
    }
}

impl Tables {
    fn job_of(&self, lock: Lock) -> Result<JobId, StoreError> {
        match lock {
            Lock::Job(id) => Ok(id),
            Lock::JobOf(attempt) => self
                .attempts
                .get(&attempt)
                .copied()
                .ok_or(StoreError::NotFound("attempt")),
        }
    }

    fn remove(&mut self, id: JobId) {
        if let Some(entry) = self.jobs.remove(&id) {
            self.keys
                .remove(&(entry.job.owner.clone(), entry.job.key.clone()));
            for a in &entry.attempts {
                self.attempts.remove(&a.id);
            }
        }
    }
}

#[async_trait]
impl Records for Memory {
    async fn job(&self, id: JobId) -> Result<Option<Job>, StoreError> {
        Ok(self.records().jobs.get(&id).map(|e| e.job.clone()))
    }

    async fn response(&self, job: JobId) -> Result<Option<StoredResponse>, StoreError> {
        let records = self.records();
        Ok(records.jobs.get(&job).and_then(|e| e.job.response.clone()))
    }

    async fn job_detail(&self, id: JobId) -> Result<Option<JobDetail>, StoreError> {
        Ok(self.records().jobs.get(&id).map(Entry::detail))
    }

    async fn find_job(
        &self,
        owner: &Owner,
        key: &IdempotencyKey,
    ) -> Result<Option<JobDetail>, StoreError> {
        let records = self.records();
        Ok(records
            .keys
            .get(&(owner.clone(), key.clone()))
            .and_then(|id| records.jobs.get(id))
            .map(Entry::detail))
    }

    async fn unknown_jobs(
        &self,
        after: Option<Cursor>,
        limit: u32,
    ) -> Result<Vec<Job>, StoreError> {
        let place = |j: &Job| (j.created_at, j.id.0);
        let mut jobs: Vec<Job> = self
            .records()
            .jobs
            .values()
            .map(|e| e.job.clone())
            .filter(|j| j.state == JobState::Unknown)
            .filter(|j| after.is_none_or(|c| place(j) < (c.created_at, c.job.0)))
            .collect();
        jobs.sort_by_key(|j| std::cmp::Reverse(place(j)));
        jobs.truncate(limit as usize);
        Ok(jobs)
    }

    async fn unknown_attempts(
        &self,
        since: SystemTime,
        limit: u32,
    ) -> Result<Vec<(JobId, AttemptId)>, StoreError> {
        let mut found: Vec<&Attempt> = Vec::new();
        let records = self.records();
        for entry in records.jobs.values() {
            found.extend(
                entry
                    .attempts
                    .iter()
                    .filter(|a| a.state == AttemptState::Unknown && a.started_at > since),
            );
        }
        found.sort_by_key(|a| (a.started_at, a.id.0));
        found.truncate(limit as usize);
        Ok(found.into_iter().map(|a| (a.job_id, a.id)).collect())
    }

    async fn renew_leases(
        &self,
        attempts: &[AttemptId],
        lease: Duration,
    ) -> Result<u64, StoreError> {
        let now = SystemTime::now();
        let mut records = self.records();
        let mut renewed = 0;
        for id in attempts {
            let Some(job) = records.attempts.get(id).copied() else {
                continue;
            };
            if let Some(entry) = records.jobs.get_mut(&job) {
                for a in entry.attempts.iter_mut() {
                    if a.id == *id && a.state == AttemptState::Started {
                        a.lease_expires_at = now + lease;
                        renewed += 1;
                    }
                }
            }
        }
        Ok(renewed)
    }

    async fn purge_expired(&self, batch: u32) -> Result<u64, StoreError> {
        let now = SystemTime::now();
        let mut records = self.records();
        let expired: Vec<JobId> = records
            .jobs
            .values()
            .filter(|e| e.forgotten(now))
            .map(|e| e.job.id)
            .take(batch as usize)
            .collect();
        for id in &expired {
            records.remove(*id);
        }
        Ok(expired.len() as u64)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn watch(&self, _job: JobId) -> Result<(), StoreError> {
        Ok(())
    }

    async fn mark_call(
        &self,
        _attempt: AttemptId,
        _instance: uuid::Uuid,
        _call: &crate::CallAt,
        _for_at_most: Duration,
    ) -> Result<(), StoreError> {
        // One process holds it: its calls are known in that process.
        Ok(())
    }

    async fn unmark_call(&self, _attempt: AttemptId) -> Result<(), StoreError> {
        Ok(())
    }

    async fn call_at_server(
        &self,
        _session: &[u8; 32],
        _call: Option<&[u8; 32]>,
        _except: uuid::Uuid,
    ) -> Result<bool, StoreError> {
        Ok(false)
    }

    async fn record_lookup(&self, attempt: AttemptId, lookup: &Lookup) -> Result<(), StoreError> {
        let mut records = self.records();
        let job = records.job_of(Lock::JobOf(attempt))?;
        let a = records
            .jobs
            .get_mut(&job)
            .and_then(|e| e.attempts.iter_mut().find(|a| a.id == attempt))
            .ok_or(StoreError::NotFound("attempt"))?;
        a.lookups.count += 1;
        a.lookups.last = Some(lookup.clone());
        Ok(())
    }
}

#[async_trait]
impl Backend for Memory {
    async fn begin(&self, new: NewJob, attempt: NewAttempt) -> Result<Begin, StoreError> {
        let now = SystemTime::now();
        let mut records = self.records();
        let slot = (new.owner.clone(), new.key.clone());
        if let Some(&id) = records.keys.get(&slot) {
            match records.jobs.get(&id) {
                Some(entry) if !entry.forgotten(now) => {
                    return Ok(Begin::Existing(entry.job.clone()))
                }
                _ => records.remove(id),
            }
        }
        let job = Job {
            id: new.id,
            owner: new.owner,
            key: new.key,
            fingerprint: new.fingerprint,
            route: new.route,
            state: JobState::Running,
            version: 1,
            attempt_count: 1,
            completed_by: None,
            response: None,
            response_in_store: None,
            created_at: now,
            expires_at: now + new.ttl,
        };
        let first = new_attempt(job.id, 1, 1, &attempt, now);
        records.keys.insert(slot, job.id);
        records.attempts.insert(first.id, job.id);
        records.jobs.insert(
            job.id,
            Entry {
                job: job.clone(),
                attempts: vec![first.clone()],
                deadlines: vec![now + attempt.deadline],
                changed_at: now,
            },
        );
        Ok(Begin::Created(job, first))
    }

    async fn commit(
        &self,
        attempt: &Attempt,
        response: &StoredResponse,
    ) -> Result<Committed, StoreError> {
        commit_under_lock(self, attempt, response).await
    }

    async fn change(
        &self,
        lock: Lock,
        decide: Decide,
    ) -> Result<Result<Applied, Refusal>, StoreError> {
        let now = SystemTime::now();
        let mut records = self.records();
        let id = records.job_of(lock)?;
        let entry = records
            .jobs
            .get_mut(&id)
            .ok_or(StoreError::NotFound("job"))?;
        let change = match decide(&entry.snapshot(), now) {
            Ok(change) => change,
            Err(refusal) => return Ok(Err(refusal)),
        };
        let started = entry.apply(&change, now);
        if let Some(a) = &started {
            records.attempts.insert(a.id, id);
        }
        Ok(Ok(Applied { change, started }))
    }

    async fn expire_lapsed(&self, batch: u32) -> Result<Vec<Change>, StoreError> {
        let now = SystemTime::now();
        let mut records = self.records();
        let snapshots: Vec<Snapshot> = records
            .jobs
            .values()
            .filter(|e| {
                e.attempts
                    .iter()
                    .any(|a| a.state == AttemptState::Started && a.lease_expires_at < now)
            })
            .take(batch as usize)
            .map(Entry::snapshot)
            .collect();
        let changes = expire_each(&snapshots, now);
        for change in &changes {
            if let Some(entry) = records.jobs.get_mut(&change.job.id) {
                entry.apply(change, now);
            }
        }
        Ok(changes)
    }
}
