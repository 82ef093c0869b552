//! The code blocks users copy, from the README and the guides in `docs/`,
//! found by their label. Each block a reader could run is preceded by an
//! HTML comment (invisible on GitHub) that says either which test runs it,
//! `<!-- run: LABEL -->`, or why none does, `<!-- not run: REASON -->`.
//! Tests take a block by its label with [`block`] (or a family of blocks by
//! a label prefix with [`blocks`]); `tests/deploy/docs.rs` fails when a
//! runnable block has neither comment, or a label no test asks for.

use std::path::{Path, PathBuf};

/// The documents whose blocks are held to this: the README, the runbook
/// and the user guides (`docs/design.md` and `docs/performance.md` are the
/// design and the measurements, not instructions).
pub fn documents() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut docs = vec![root.join("README.md")];
    let mut guides: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .filter(|p| !p.ends_with("design.md") && !p.ends_with("performance.md"))
        .collect();
    guides.sort();
    docs.extend(guides);
    docs
}

/// What the comment above a block says of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mark {
    /// `<!-- run: LABEL -->`.
    Run(String),
    /// `<!-- not run: REASON -->`.
    NotRun(String),
    /// No comment.
    None,
}

/// A fenced code block.
#[derive(Debug, Clone)]
pub struct Block {
    /// The file it is in, relative to the repository.
    pub file: String,
    /// Its line (1-based) of the opening fence.
    pub line: usize,
    /// The fence's language (`sh`, `python`, `toml`, …).
    pub lang: String,
    /// What is between the fences, with the final newline.
    pub text: String,
    /// The comment above it.
    pub mark: Mark,
}

/// Every fenced block of `path`.
pub fn blocks_of(path: &Path) -> Vec<Block> {
    let text = std::fs::read_to_string(path).unwrap();
    let file = path
        .strip_prefix(env!("CARGO_MANIFEST_DIR"))
        .unwrap()
        .display()
        .to_string();
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let Some(lang) = lines[i].trim_start().strip_prefix("```") else {
            i += 1;
            continue;
        };
        let indent = lines[i].len() - lines[i].trim_start().len();
        let end = (i + 1..lines.len())
            .find(|&j| lines[j].trim_start().starts_with("```"))
            .unwrap_or_else(|| panic!("{file}:{}: a block without its end", i + 1));
        let body: String = lines[i + 1..end]
            .iter()
            .map(|l| format!("{}\n", l.get(indent..).unwrap_or(l.trim_start())))
            .collect();
        found.push(Block {
            file: file.clone(),
            line: i + 1,
            lang: lang.trim().to_owned(),
            text: body,
            mark: mark_above(&lines[..i]),
        });
        i = end + 1;
    }
    found
}

/// The marking comment on the last non-blank line before a block.
fn mark_above(before: &[&str]) -> Mark {
    let Some(line) = before.iter().rev().find(|l| !l.trim().is_empty()) else {
        return Mark::None;
    };
    let line = line.trim();
    let Some(inner) = line
        .strip_prefix("<!--")
        .and_then(|l| l.strip_suffix("-->"))
    else {
        return Mark::None;
    };
    let inner = inner.trim();
    if let Some(label) = inner.strip_prefix("run:") {
        Mark::Run(label.trim().to_owned())
    } else if let Some(reason) = inner.strip_prefix("not run:") {
        Mark::NotRun(reason.trim().to_owned())
    } else {
        Mark::None
    }
}

/// Every block of every document.
pub fn all() -> Vec<Block> {
    documents().iter().flat_map(|d| blocks_of(d)).collect()
}

/// The block labelled `label`, exactly one, in any document.
pub fn block(label: &str) -> String {
    let mut found: Vec<Block> = all()
        .into_iter()
        .filter(|b| b.mark == Mark::Run(label.to_owned()))
        .collect();
    assert_eq!(
        found.len(),
        1,
        "one block labelled {label:?}, found {found:?}"
    );
    found.remove(0).text
}

/// Every block whose label starts with `prefix`, with its label.
pub fn blocks(prefix: &str) -> Vec<(String, String)> {
    let found: Vec<(String, String)> = all()
        .into_iter()
        .filter_map(|b| match b.mark {
            Mark::Run(label) if label.starts_with(prefix) => Some((label, b.text)),
            _ => None,
        })
        .collect();
    assert!(!found.is_empty(), "no block labelled {prefix}…");
    found
}
