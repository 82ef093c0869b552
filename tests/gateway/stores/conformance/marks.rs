//! Marks of MCP calls at their server (`docs/design.md` §19, "An agent's
//! cancel"): another replica's mark holds a cancel back for a lease, which
//! its attempt's renewals renew, up to the attempt's deadline.

use super::batches::postgres_with_probe;
use super::*;

use idemgate_store::CallAt;

/// A mark is good for what it was given (a lease) and counts for other
/// instances only. A renewal of its attempt renews it, whatever the
/// attempt's state (a call recorded `unknown` at `first_byte_timeout` is
/// still at its server), capped at the attempt's deadline; a mark nobody
/// renews (its replica died) lapses after its lease. Before, a mark was
/// good until the deadline from the start and nothing renewed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_mark_lasts_while_its_attempt_is_renewed() {
    let (store, _probe, db) = postgres_with_probe().await;
    let (_, renewed) = created(store.as_ref(), "renewed").await;
    let (_, orphaned) = created(store.as_ref(), "orphaned").await;
    let at = |n: u8| CallAt {
        session: [n; 32],
        call: [n + 100; 32],
    };
    let (ours, other) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let lease = Duration::from_secs(2);
    store
        .mark_call(renewed.id, ours, &at(1), lease)
        .await
        .unwrap();
    store
        .mark_call(orphaned.id, ours, &at(2), lease)
        .await
        .unwrap();
    let marked = async |n: u8, except: uuid::Uuid| -> (bool, bool) {
        let at = at(n);
        let session = store.call_at_server(&at.session, None, except).await;
        let call = store
            .call_at_server(&at.session, Some(&at.call), except)
            .await;
        (session.unwrap(), call.unwrap())
    };
    assert_eq!(marked(1, other).await, (true, true));
    assert_eq!(marked(2, other).await, (true, true));
    assert_eq!(marked(1, ours).await, (false, false), "its own replica");

    // The call went silent past its first-byte timeout: its attempt is
    // unknown, its replica still waits for a late answer and renews.
    let unknown = AttemptFailure::Unknown {
        detail: "silent past first_byte_timeout".into(),
    };
    assert!(store.fail_attempt(renewed.id, unknown).await.unwrap());
    let an_hour = Duration::from_secs(3600);
    store.renew_leases(&[renewed.id], an_hour).await.unwrap();
    let capped: bool = db
        .connect()
        .await
        .query_one(
            "SELECT m.good_until = a.deadline_at FROM mcp_calls_at_server m \
             JOIN attempts a ON a.id = m.attempt_id WHERE m.attempt_id = $1",
            &[&renewed.id.0],
        )
        .await
        .unwrap()
        .get(0);
    assert!(capped, "renewed up to the attempt's deadline, not past it");

    crate::support::eventually(
        Duration::from_secs(10),
        "the mark nobody renewed lapsed",
        || async { marked(2, other).await == (false, false) },
    )
    .await;
    assert_eq!(
        marked(1, other).await,
        (true, true),
        "the renewed one holds"
    );
}
