//! Wake-ups from other replicas: `LISTEN` on a session of its own
//! (docs/design.md §7), and what the gateway checks of the server each time
//! that session connects (§13).

use futures_util::StreamExt;
use tokio_postgres::AsyncMessage;
use uuid::Uuid;

use super::{map_pg, Budget, Postgres, Replication};
use crate::{Doorbell, StoreError};
use idemgate_domain::id::JobId;

/// The channel job-state changes are announced on.
const CHANNEL: &str = "idemgate_jobs";

impl Postgres {
    /// Listens for job-state changes announced by other replicas and rings
    /// `doorbell` for each. Returns when the connection is lost (the caller
    /// reconnects); rings every bell once listening, since announcements
    /// made while nobody listened were lost.
    pub async fn listen(&self, doorbell: &Doorbell) -> Result<(), StoreError> {
        let (client, mut connection) = self.direct.connect().await?;
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        let (heard, mut announcements) = tokio::sync::mpsc::unbounded_channel();
        let mut driver = tokio::spawn(async move {
            while let Some(message) = messages.next().await {
                match message {
                    Ok(AsyncMessage::Notification(n)) => {
                        let _ = heard.send(n.payload().to_owned());
                    }
                    Ok(_) => {}
                    Err(e) => return Err(map_pg(e)),
                }
            }
            Ok(())
        });
        self.check(&client).await;
        client
            .batch_execute(&format!("LISTEN {CHANNEL}"))
            .await
            .map_err(map_pg)?;
        // Duplicates held while nobody listened look again.
        doorbell.ring_all();
        loop {
            tokio::select! {
                ended = &mut driver => {
                    return ended.unwrap_or_else(|e| Err(StoreError::Internal(Box::new(e))));
                }
                Some(payload) = announcements.recv() => {
                    // `<job id> <instance>`; an untagged payload rings too.
                    let mut parts = payload.split(' ');
                    let job = parts.next().and_then(|j| j.parse().ok());
                    let origin = parts.next().and_then(|i| i.parse::<Uuid>().ok());
                    if let Some(job) = job {
                        if origin != Some(self.instance) {
                            metrics::counter!("idemgate_wakeups_total", "source" => "postgres").increment(1);
                            doorbell.ring_local(JobId(job));
                        }
                    }
                }
            }
        }
    }

    /// Warns of what the gateway can see is wrong with the database it
    /// (re)connected to: replication that can lose acknowledged commits on
    /// a failover, a pool that will not fit.
    async fn check(&self, client: &tokio_postgres::Client) {
        match Replication::read(client).await {
            Ok(replication) => match replication.risk() {
                Some(risk) => tracing::warn!("{risk}"),
                None => tracing::debug!(?replication, "replication keeps acknowledged commits"),
            },
            Err(e) => tracing::debug!(error = %e, "cannot read the database's replication"),
        }
        match Budget::read(client).await {
            Ok(budget) => {
                if let Some(risk) = budget.risk(self.pool_size) {
                    tracing::warn!("{risk}");
                }
            }
            Err(e) => tracing::debug!(error = %e, "cannot read the database's connection budget"),
        }
    }
}
