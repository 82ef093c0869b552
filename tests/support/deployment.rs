//! What a test's gateways run on: a fresh embedded (SQLite) file, a fresh
//! PostgreSQL database, or one with a throwaway Redis server of its own
//! (so no other test's cached answers are seen). Tests that make sense on
//! several are written once and instantiated for each by
//! [`on_each_deployment!`](crate::on_each_deployment).

use super::gateway::Builder;
use super::{Gateway, TestStore, ThrowawayRedis};

pub struct Deployment {
    pub store: TestStore,
    /// The deployment's own Redis, if it has one.
    pub redis: Option<ThrowawayRedis>,
}

impl Deployment {
    /// One gateway on its embedded store.
    pub async fn embedded() -> Deployment {
        Deployment {
            store: TestStore::embedded(),
            redis: None,
        }
    }

    /// Gateways on a fresh PostgreSQL database, without Redis.
    pub async fn postgres() -> Deployment {
        Deployment {
            store: TestStore::postgres().await,
            redis: None,
        }
    }

    /// Gateways on a fresh PostgreSQL database, with a throwaway Redis.
    pub async fn postgres_redis() -> Deployment {
        Deployment {
            store: TestStore::postgres().await,
            redis: Some(ThrowawayRedis::start().await),
        }
    }

    /// A gateway of this deployment in front of `upstream`.
    pub fn gateway(&self, upstream: &str) -> Builder {
        let builder = Gateway::builder(&self.store, upstream);
        match &self.redis {
            Some(redis) => builder.set("redis_url", &format!("{:?}", redis.url())),
            None => builder,
        }
    }
}

/// For tests that need only the store: a deployment without Redis is its
/// store.
impl From<Deployment> for TestStore {
    fn from(deployment: Deployment) -> TestStore {
        assert!(
            deployment.redis.is_none(),
            "a test taking a TestStore would drop its deployment's Redis"
        );
        deployment.store
    }
}

/// Instantiates each named test once per deployment: for each set-up (a
/// constructor of [`Deployment`](crate::support::deployment::Deployment):
/// `embedded`, `postgres`, `postgres_redis`) a module of that name holding
/// one `#[tokio::test]` per name, which calls the test function of that
/// name with the deployment (or, through `From`, its `TestStore`).
///
/// ```ignore
/// async fn replays(deployment: Deployment) { … }
/// async fn races(store: TestStore) { … }
///
/// crate::on_each_deployment!([embedded, postgres_redis] replays);
/// crate::on_each_deployment!([embedded, postgres] races);
/// ```
///
/// makes `embedded::replays`, `postgres_redis::replays`, … (one invocation
/// per module, since each makes the set-ups' modules).
#[macro_export]
macro_rules! on_each_deployment {
    ([$($setup:ident),+ $(,)?] $($name:ident),* $(,)?) => {
        $crate::on_each_deployment!(@setups [$($setup),+] [$($name),*]);
    };
    (@setups [$setup:ident $(, $rest:ident)*] $names:tt) => {
        $crate::on_each_deployment!(@setup $setup $names);
        $crate::on_each_deployment!(@setups [$($rest),*] $names);
    };
    (@setups [] $names:tt) => {};
    (@setup $setup:ident [$($name:ident),*]) => {
        mod $setup {
            $(
                #[tokio::test]
                async fn $name() {
                    let deployment =
                        $crate::support::deployment::Deployment::$setup().await;
                    super::$name(::std::convert::Into::into(deployment)).await
                }
            )*
        }
    };
}
