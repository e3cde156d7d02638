//! Opening the history database (creating, migrating, marking the runs of dead processes
//! interrupted), the transaction every write goes through, and closing it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};

use crate::{Store, StoreError, locks};

/// The schema, embedded from the top-level `migrations/` directory.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

/// `<data dir>/baton/history.sqlite`.
pub fn default_path(data_dir: &Path) -> PathBuf {
    data_dir.join("baton").join("history.sqlite")
}

impl Store {
    /// Opens (creating it and its directory if needed) and migrates the database at `path`,
    /// then marks runs whose recording process is gone as interrupted.
    pub async fn open(path: &Path) -> Result<Store, StoreError> {
        let shown = path.display().to_string();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| StoreError::Open {
                path: shown.clone(),
                message: format!("cannot create {}: {e}", dir.display()),
            })?;
        }
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .foreign_keys(true)
            .busy_timeout(Duration::from_secs(10));
        // sqlx cannot lock SQLite for migrating, so two processes opening a new history at
        // once (the app and the CLI, or two CLI runs) would both apply migration 1 and one
        // would fail. Opening is serialized by a lock file instead; it is held until the
        // database is migrated and its dead runs are marked.
        let _opening = locks::lock_opening(path).await?;
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .map_err(|e| classify_open_error(&shown, &e))?;
        MIGRATOR.run(&pool).await.map_err(|e| {
            let message = e.to_string();
            if message.contains("not a database") || message.contains("malformed") {
                StoreError::Corrupt { path: shown.clone(), message }
            } else {
                StoreError::Migrate { path: shown.clone(), message }
            }
        })?;
        let store = Store { pool, path: path.to_path_buf(), slots: std::sync::Arc::new(locks::Slots::new(path)) };
        store.mark_interrupted().await?;
        locks::remove_dead_slots(path);
        Ok(store)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Closes the connections (and checkpoints the WAL).
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Runs still `running` whose recorder no longer holds their lock file died with their
    /// process: they become `interrupted`, with their finished steps intact.
    async fn mark_interrupted(&self) -> Result<(), StoreError> {
        let running: Vec<(i64, String)> =
            sqlx::query_as("SELECT id, coalesce(recorder, uid) FROM runs WHERE status = 'running'")
                .fetch_all(&self.pool)
                .await?;
        for (id, lock) in running {
            if locks::is_live(&self.path, &lock) {
                continue;
            }
            let mut tx = self.write().await?;
            sqlx::query("UPDATE runs SET status = 'interrupted' WHERE id = ?1 AND status = 'running'")
                .bind(id)
                .execute(&mut *tx)
                .await?;
            sqlx::query("UPDATE steps SET status = 'interrupted' WHERE run_id = ?1 AND status = 'running'")
                .bind(id)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            locks::remove_lock(&self.path, &lock);
        }
        Ok(())
    }

    /// A transaction that writes. It takes the database's write lock when it begins (waiting
    /// out the busy timeout), not at its first write: a deferred transaction that read before
    /// another connection wrote cannot upgrade, and SQLite fails it at once whatever the
    /// timeout, which broke runs recorded side by side (an evaluation's, a comparison's).
    pub(crate) async fn write(&self) -> Result<sqlx::Transaction<'static, sqlx::Sqlite>, sqlx::Error> {
        self.pool.begin_with("BEGIN IMMEDIATE").await
    }
}

fn classify_open_error(path: &str, e: &sqlx::Error) -> StoreError {
    let message = e.to_string();
    if message.contains("not a database") || message.contains("malformed") {
        StoreError::Corrupt { path: path.to_owned(), message }
    } else {
        StoreError::Open { path: path.to_owned(), message }
    }
}
