//! The idempotency layer: one intent, one job, exactly one committed result
//! (`docs/design.md` §2).
//!
//! A request on an opted-in route that carries an `Idempotency-Key`:
//!
//! 1. [`opt_in`]: the route and key are told from the head; the owner is
//!    derived, the body read (bounded) and the request fingerprinted;
//! 2. [`replay::tiers`]: an answer this very request already has is replayed
//!    from memory or Redis;
//! 3. [`flow`]: the store's uniqueness constraint decides whether the
//!    request owns a new job; an existing one is decided on by its state:
//!    replay, [hold] a duplicate, refuse, or claim the next attempt;
//! 4. [`dispatch`]: the attempts of a request that owns its job run as a
//!    pure state machine decides (failover, hedging), driven by a small
//!    driver beside it;
//! 5. [`execute`]: each attempt runs in its own task, so a client that hangs
//!    up cannot cut it short; its answer is committed by CAS before anyone
//!    sees it, and a streamed one is [recorded](recording) for every reader;
//! 6. [`resume`]: a retry that names where its stream broke off gets only
//!    what follows.
//!
//! Everything else (no key on a route that does not require one, methods or
//! paths that do not opt in) goes to the inner service untouched, streamed:
//! it never enters the flow.

#![warn(unreachable_pub, missing_docs)]

mod dispatch;
pub mod error;
mod execute;
mod flow;
mod hold;
mod keyed;
mod layer;
mod mcp;
mod method_override;
mod opt_in;
mod poll;
mod recording;
mod replay;
mod respond_async;
mod resume;
pub mod route;
mod shared;

pub use execute::{Config as AttemptConfig, UpstreamService, ANSWER_WEIGHT};
pub use hold::Config as HoldConfig;
pub use layer::{Idempotency, IdempotencyLayer};
pub use shared::{Config, Runtime, Shared};

#[cfg(test)]
mod testing;
#[cfg(test)]
mod tests;
