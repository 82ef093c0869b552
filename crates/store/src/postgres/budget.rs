//! The connection budget: every replica's pool on one server must fit in
//! its `max_connections` (docs/design.md §13). A replica cannot see how many
//! others will start, but it can see what is left when it does.

use tokio_postgres::Client;

/// What the server allows and what is in use.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Budget {
    /// `max_connections`.
    pub max: i32,
    /// Kept for superusers (`superuser_reserved_connections`).
    pub reserved: i32,
    /// Client connections open now, this one included.
    pub in_use: i64,
}

impl Budget {
    /// Reads it on `client`.
    pub(super) async fn read(client: &Client) -> Result<Self, tokio_postgres::Error> {
        let row = client
            .query_one(
                "SELECT current_setting('max_connections')::int, \
                        current_setting('superuser_reserved_connections')::int, \
                        (SELECT count(*) FROM pg_stat_activity \
                          WHERE backend_type = 'client backend')",
                &[],
            )
            .await?;
        Ok(Budget {
            max: row.get(0),
            reserved: row.get(1),
            in_use: row.get(2),
        })
    }

    /// Why a pool of `pool_size` might not fit, if it might not.
    pub fn risk(&self, pool_size: usize) -> Option<String> {
        let free = i64::from(self.max - self.reserved) - self.in_use;
        (pool_size as i64 > free).then(|| {
            format!(
                "database_pool_size = {pool_size}, but the database has {free} connections left \
                 (max_connections {} - {} reserved - {} in use): requests will wait for \
                 connections and answer 503 under load; lower database_pool_size, raise \
                 max_connections, or put PgBouncer in front (budget: pool size x replicas \
                 <= max_connections - reserved - other clients)",
                self.max, self.reserved, self.in_use
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_larger_than_what_is_left_is_a_risk() {
        let budget = Budget {
            max: 100,
            reserved: 3,
            in_use: 80,
        };
        assert_eq!(budget.risk(17), None);
        let risk = budget.risk(18).unwrap();
        assert!(risk.contains("17 connections left"), "{risk}");
    }
}
