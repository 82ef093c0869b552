//! The identities of jobs and attempts: UUIDv7, time-ordered, so the
//! primary-key indexes stay append-mostly.

use std::fmt;

use uuid::Uuid;

macro_rules! id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub Uuid);

        impl $name {
            /// A new, time-ordered id.
            pub fn new() -> Self {
                $name(Uuid::now_v7())
            }
        }

        impl Default for $name {
            fn default() -> Self {
                Self::new()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

id! {
    /// The stable identity of a job; forwarded upstream as its idempotency key.
    JobId
}

id! {
    /// The identity of one attempt.
    AttemptId
}
