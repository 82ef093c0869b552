//! The two deployments a contract test runs on: one gateway on its
//! embedded store, and one on PostgreSQL with Redis (a throwaway server of
//! its own, so no other test's cached answers are seen). Tests written
//! once, taking a `Deployment`, are instantiated for each by
//! `on_embedded_and_postgres_redis!`.

use super::gateway::Builder;
use super::{Gateway, TestStore, ThrowawayRedis};

pub struct Deployment {
    pub store: TestStore,
    redis: Option<ThrowawayRedis>,
}

impl Deployment {
    pub fn embedded() -> Deployment {
        Deployment {
            store: TestStore::embedded(),
            redis: None,
        }
    }

    pub async fn postgres_and_redis() -> Deployment {
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

/// Instantiates each named `async fn(Deployment)` once per deployment.
#[macro_export]
macro_rules! on_embedded_and_postgres_redis {
    ($($name:ident),* $(,)?) => {
        mod postgres_redis {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name($crate::support::deployment::Deployment::postgres_and_redis().await).await
                }
            )*
        }
        mod embedded {
            $(
                #[tokio::test]
                async fn $name() {
                    super::$name($crate::support::deployment::Deployment::embedded()).await
                }
            )*
        }
    };
}
