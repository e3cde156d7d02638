//! What the OpenAI-compatible server spent per day (UTC), for its daily cap.

use crate::{Store, StoreError};

impl Store {
    /// What the server spent on `day` (days since 1970, UTC): 0 for a day it spent nothing.
    pub async fn serve_spend(&self, day: u64) -> Result<f64, StoreError> {
        let spent: Option<f64> = sqlx::query_scalar("SELECT usd FROM serve_spend WHERE day = ?")
            .bind(i64::try_from(day).unwrap_or(i64::MAX))
            .fetch_optional(&self.pool)
            .await?;
        Ok(spent.unwrap_or(0.0))
    }
}

/// Adds `usd` to what the server spent on `day` (days since 1970, UTC), in a transaction
/// already open (see [`Store::record_many`]).
pub(crate) fn add(conn: &rusqlite::Connection, day: u64, usd: f64) -> Result<(), StoreError> {
    conn.prepare_cached(
        "INSERT INTO serve_spend (day, usd) VALUES (?, ?) ON CONFLICT (day) DO UPDATE SET usd = usd + excluded.usd",
    )?
    .execute(rusqlite::params![i64::try_from(day).unwrap_or(i64::MAX), usd])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[tokio::test]
    async fn a_days_spending_adds_up_and_other_days_are_apart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = crate::Store::open(&dir.path().join("h.sqlite")).await.expect("open");
        assert_eq!(store.serve_spend(20_000).await.expect("read"), 0.0);
        // A server adds a day's spending with the runs it records (here none).
        for (day, usd) in [(20_000, 0.25), (20_000, 0.5), (20_001, 2.0)] {
            store.record_many(&mut [], Some((day, usd))).await.expect("add");
        }
        assert_eq!(store.serve_spend(20_000).await.expect("read"), 0.75);
        assert_eq!(store.serve_spend(20_001).await.expect("read"), 2.0);
    }
}
