//! Marks of MCP calls at their server (`docs/design.md` §19, "An agent's
//! cancel"): another replica's mark holds a cancel back only while the
//! call's attempt may still be at its server.

use super::batches::postgres_with_probe;
use super::*;

use idemgate_store::CallAt;

/// A mark counts while its attempt is `started` under a held lease, and
/// for other instances only. It stops counting once that lease lapses (the
/// replica that ran the call died and renews nothing: before, its mark
/// held the session's `DELETE` back until the attempt's deadline), and
/// once the attempt is settled (a take-off that never landed), though the
/// mark itself is still there and good until its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_mark_counts_only_while_its_attempt_holds_its_lease() {
    let (store, _probe, db) = postgres_with_probe().await;
    let (_, lapsing) = created(store.as_ref(), "lapsing").await;
    let (_, settled) = created(store.as_ref(), "settled").await;
    let at = |n: u8| CallAt {
        session: [n; 32],
        call: [n + 100; 32],
    };
    let (ours, other) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let an_hour = Duration::from_secs(3600);
    store
        .mark_call(lapsing.id, ours, &at(1), an_hour)
        .await
        .unwrap();
    store
        .mark_call(settled.id, ours, &at(2), an_hour)
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

    let client = db.connect().await;
    client
        .execute(
            "UPDATE attempts SET lease_expires_at = now() - interval '1 second' WHERE id = $1",
            &[&lapsing.id.0],
        )
        .await
        .unwrap();
    assert_eq!(marked(1, other).await, (false, false), "lease lapsed");

    let outcome = store.commit(&settled, &response("settled")).await.unwrap();
    assert!(matches!(outcome, CommitOutcome::Committed), "{outcome:?}");
    assert_eq!(marked(2, other).await, (false, false), "attempt settled");

    let left: i64 = client
        .query_one("SELECT count(*) FROM mcp_calls_at_server", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        left, 2,
        "both marks are still there, good until their deadline"
    );
}
