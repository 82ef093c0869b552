//! What operators and users deploy and copy: the Helm chart (with its
//! dashboard and alerts), the container image, and the README's and the
//! chat example's commands, each run as written against the real binary.

#[path = "../support/mod.rs"]
mod support;

mod chart;
mod chat_example;
mod docs;
mod image;
mod layers;
mod readme;
