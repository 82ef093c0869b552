//! The HTTP contract of a keyed request: answers and replays, how attempts end, races, keys, fingerprints, paths, duplicates in progress, the IETF draft's conformance suite and clients nobody here wrote.

mod answers;
mod draft_conformance;
mod fingerprints;
mod in_progress;
mod keys;
mod outcomes;
mod pass_through;
mod paths;
mod races;
mod real_clients;
mod start_up;
mod store_down;
