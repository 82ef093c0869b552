//! The dispatch of one keyed request that owns its job (`docs/design.md`
//! §6): the pure [machine] that decides what to try next, its [driver]
//! (`drive`) that does the I/O, and the [attempts] it runs together.
//!
//! [driver]: drive

pub(crate) mod attempts;
pub(crate) mod drive;
pub(crate) mod machine;

pub(crate) use attempts::joined;
pub(crate) use drive::{Begun, Driver};
pub(crate) use machine::Joining;
