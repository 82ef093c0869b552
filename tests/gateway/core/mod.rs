//! The HTTP contract of a keyed request: answers, outcomes, races, keys, paths, duplicates.

mod answers;
mod draft_conformance;
mod encodings;
mod fingerprints;
mod in_progress;
mod keys;
mod outcomes;
mod pass_through;
mod paths;
mod races;
mod real_clients;
mod request_lines;
mod respond_async;
mod start_up;
mod store_down;
