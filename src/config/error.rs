//! A configuration problem, naming the key and the fix; or several, when
//! each stands alone (every missing secret at once, `secrets`).

use std::fmt::{self, Display, Formatter};

/// A start-up configuration problem, naming the key and the fix.
#[derive(Debug)]
pub struct ConfigError {
    /// The offending key (as written in the file; flags and variables named in the message).
    pub key: String,
    /// What is wrong and how to fix it.
    pub message: String,
    /// Other problems found with it, each as independent of the rest (the
    /// other missing secrets): all are told at once, so one edit fixes all.
    pub others: Vec<ConfigError>,
}

impl ConfigError {
    /// A problem with `key`, and how to fix it.
    pub fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError {
            key: key.into(),
            message: message.into(),
            others: Vec::new(),
        }
    }

    /// Several problems told as one, the first first; `None` when there
    /// are none.
    pub fn all(mut problems: Vec<ConfigError>) -> Option<Self> {
        if problems.is_empty() {
            return None;
        }
        let mut first = problems.remove(0);
        first.others.extend(problems);
        Some(first)
    }

    /// This problem and the others, in order.
    pub fn each(&self) -> impl Iterator<Item = &ConfigError> {
        std::iter::once(self).chain(&self.others)
    }
}

impl std::error::Error for ConfigError {}

impl Display for ConfigError {
    fn fmt(&self, f: &mut Formatter<'_>) -> fmt::Result {
        if self.others.is_empty() {
            return write!(f, "invalid configuration: `{}`: {}", self.key, self.message);
        }
        write!(
            f,
            "invalid configuration: {} problems, each to fix:",
            self.others.len() + 1
        )?;
        for problem in self.each() {
            write!(f, "\n  - `{}`: {}", problem.key, problem.message)?;
        }
        Ok(())
    }
}
