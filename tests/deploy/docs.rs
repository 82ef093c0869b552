//! What users copy must run: every block of the README, the runbook and the
//! guides in `docs/` that a reader could run is either run by a test, which
//! takes it by the label of its `<!-- run: LABEL -->` comment, or says why
//! not (`<!-- not run: REASON -->`, a cluster or minutes of load); and every
//! link between them leads somewhere.

use std::collections::BTreeSet;
use std::path::Path;

use crate::support::docs::{self, Mark};

/// Languages of blocks a reader runs or writes into a file; `text` blocks
/// show what comes out.
const RUNNABLE: &[&str] = &["sh", "bash", "console", "python", "toml", "yaml", "json"];

/// Every `block("…")` and `blocks("…")` argument in the tests' sources.
fn asked_for() -> (BTreeSet<String>, BTreeSet<String>) {
    fn walk(dir: &Path, texts: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, texts);
            } else if path.extension().is_some_and(|e| e == "rs") {
                texts.push(std::fs::read_to_string(&path).unwrap());
            }
        }
    }
    let mut texts = Vec::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests"),
        &mut texts,
    );
    let args = |call: &str| -> BTreeSet<String> {
        texts
            .iter()
            .flat_map(|t| t.split(call).skip(1))
            .filter_map(|rest| rest.strip_prefix('"')?.split('"').next())
            .map(str::to_owned)
            .collect()
    };
    (args("docs::block("), args("docs::blocks("))
}

#[test]
fn every_block_a_reader_could_run_is_run_by_a_test_or_says_why_not() {
    let (labels, prefixes) = asked_for();
    let mut unmarked = Vec::new();
    let mut orphans = Vec::new();
    let mut seen = BTreeSet::new();
    let all = docs::all();
    assert!(all.len() > 20, "the documents' blocks were found: {all:?}");
    for block in all {
        if !RUNNABLE.contains(&block.lang.as_str()) {
            continue;
        }
        let at = format!("{}:{}", block.file, block.line);
        match &block.mark {
            Mark::None => unmarked.push(at),
            Mark::NotRun(reason) => assert!(reason.len() > 15, "{at}: say why: {reason:?}"),
            Mark::Run(label) => {
                assert!(seen.insert(label.clone()), "{at}: label {label} twice");
                let asked = labels.contains(label) || prefixes.iter().any(|p| label.starts_with(p));
                if !asked {
                    orphans.push(format!("{at} ({label})"));
                }
            }
        }
    }
    assert!(
        unmarked.is_empty(),
        "blocks with neither `<!-- run: LABEL -->` nor `<!-- not run: REASON -->`: {unmarked:#?}"
    );
    assert!(
        orphans.is_empty(),
        "labelled blocks no test runs: {orphans:#?}"
    );
}

/// GitHub's anchor of a heading.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

fn anchors(text: &str) -> BTreeSet<String> {
    let mut fenced = false;
    text.lines()
        .filter(|l| {
            if l.trim_start().starts_with("```") {
                fenced = !fenced;
            }
            !fenced && l.starts_with('#')
        })
        .map(|l| slug(l.trim_start_matches('#')))
        .collect()
}

#[test]
fn every_link_between_the_documents_leads_somewhere() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut broken = Vec::new();
    for doc in docs::documents() {
        let text = std::fs::read_to_string(&doc).unwrap();
        for target in text.split("](").skip(1).filter_map(|r| r.split(')').next()) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
            let path = if file.is_empty() {
                doc.clone()
            } else {
                doc.parent().unwrap().join(file)
            };
            if !path.exists() {
                broken.push(format!("{}: {target} (no such file)", doc.display()));
                continue;
            }
            let is_md = path.extension().is_some_and(|e| e == "md");
            if !anchor.is_empty() && is_md {
                let there = anchors(&std::fs::read_to_string(&path).unwrap());
                if !there.contains(anchor) {
                    broken.push(format!("{}: {target} (no such heading)", doc.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "{broken:#?}");
    assert!(root.join("docs/runbook.md").exists());
}
