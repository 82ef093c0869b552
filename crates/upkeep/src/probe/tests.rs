//! The probe board's standings, verdicts and `verify-providers`' output.

use super::*;

fn verdict(result: &'static str) -> Verdict {
    Verdict {
        result,
        checked_at: SystemTime::now(),
        failures: Vec::new(),
    }
}

/// Eligibility after each of `results`, in turn.
fn eligibility(results: &[&'static str], recover_after: u32) -> Vec<bool> {
    let mut standing = Standing::default();
    results
        .iter()
        .map(|r| {
            standing.after(verdict(r), recover_after);
            standing.eligible
        })
        .collect()
}

#[test]
fn the_first_pass_makes_eligible_and_a_failure_needs_recover_after_passes() {
    assert_eq!(
        eligibility(&["pass", "pass", "fail", "pass", "pass", "pass"], 2),
        [true, true, false, false, true, true]
    );
    assert_eq!(
        eligibility(
            &["pass", "unstable", "pass", "unstable", "pass", "pass", "pass"],
            3
        ),
        [true, false, false, false, false, false, true],
        "unstable is not eligible, and interrupts a recovery"
    );
    assert_eq!(
        eligibility(&["fail", "pass", "pass"], 2),
        [false, false, true],
        "failing the first verification counts as a failure"
    );
    assert_eq!(eligibility(&["fail", "pass"], 1), [false, true]);
}

#[test]
fn the_standing_says_how_many_passes_are_still_needed_and_keeps_twenty_verdicts() {
    let mut standing = Standing::default();
    standing.after(verdict("fail"), 3);
    assert_eq!(standing.needed, 3);
    standing.after(verdict("pass"), 3);
    assert_eq!((standing.needed, standing.passes_in_a_row), (2, 1));
    for _ in 0..30 {
        standing.after(verdict("pass"), 3);
    }
    assert_eq!(standing.needed, 0);
    assert_eq!(standing.history.len(), HISTORY);
    assert!(standing.last().unwrap().passed());
}

#[test]
fn a_verification_fails_on_any_failed_probe_else_is_unstable_on_any_unstable_one() {
    let result = |finding: Finding| ProbeResult {
        upstream: "b".into(),
        contract: "c".into(),
        probe: format!("p-{}", finding.as_str()),
        finding,
        prompt_tokens: Vec::new(),
    };
    let unstable = || result(Finding::Unstable("differed".into()));
    let failed = || result(Finding::Fail("wrong".into()));
    assert_eq!(Verdict::of(&[result(Finding::Pass)]).result, "pass");
    let v = Verdict::of(&[result(Finding::Pass), unstable()]);
    assert_eq!(v.result, "unstable");
    assert_eq!(
        (v.failures[0].probe.as_str(), v.failures[0].why.as_str()),
        ("p-unstable", "differed")
    );
    assert_eq!(Verdict::of(&[unstable(), failed()]).result, "fail");
    assert_eq!(Verdict::of(&[unstable(), failed()]).failures.len(), 2);
}

#[test]
fn the_table_and_the_json_show_each_result_with_the_prompt_tokens_seen() {
    let rows = [
        ProbeResult {
            upstream: "provider-a".into(),
            contract: "chat-json".into(),
            probe: "capital".into(),
            finding: Finding::Pass,
            prompt_tokens: vec![27, 27, 27],
        },
        ProbeResult {
            upstream: "provider-b".into(),
            contract: "chat-json".into(),
            probe: "capital".into(),
            finding: Finding::Fail("/answer: expected \"Paris\", got \"Lyon\"".into()),
            prompt_tokens: Vec::new(),
        },
    ];
    let table = table(&rows);
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].contains("prompt tokens"), "{table}");
    assert!(lines[1].starts_with("provider-a") && lines[1].contains("pass"));
    assert!(lines[1].contains("27,27,27"), "{table}");
    assert!(lines[2].contains("FAIL") && lines[2].contains("got \"Lyon\""));
    let json = json(&rows);
    assert_eq!(json[0]["result"], "pass");
    assert_eq!(json[0]["prompt_tokens"], serde_json::json!([27, 27, 27]));
    assert_eq!(json[0]["why"], serde_json::Value::Null);
    assert_eq!(json[1]["result"], "fail");
    assert!(json[1]["why"].as_str().unwrap().contains("Lyon"));
}
