//! Opening a history: migrations from an empty file, released migrations never edited, many
//! processes creating the same new file at once, and databases from older releases upgraded.

use baton_store::Store;
use baton_testserver::TestServer;

use crate::{FANOUT, pool, run_recorded};

#[tokio::test]
async fn migrations_apply_to_an_empty_file_and_released_ones_never_change() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("nested").join("history.sqlite");
    let store = Store::open(&path).await.expect("opens");
    assert!(path.exists());
    assert!(store.list_runs(10, None).await.expect("list").is_empty());
    store.close().await;
    // Opening again applies nothing new and keeps working.
    Store::open(&path).await.expect("reopens");

    // Editing a released migration breaks every existing database: sqlx refuses to run on a
    // checksum mismatch. Add a new migration file instead, and its checksum here.
    const RELEASED: &[(i64, &str)] = &[
        (1, "89a08f03767746845efb4936d1fface9315bbe04d0b54e459e4f1858711270934aadb624aa603f9b2f0f201bf5dec62a"),
        (2, "b97755a42f4e4dfb71ad8f55fd67b58466a4f5012e53a674024c6e570d5d83f491a9412f7baf6b5a5e50a0d1ea1cb313"),
        (3, "a92e0e8b46c3c8a8cbbab20d2f5e8f8b679b5542ef9eb324d91d24f603599ce634535ebe1cde99343c81ad355989e7e7"),
        (4, "4d18937e6a272e06829067468bb819194496efd22374e5ee226cd823195bdb476af8cc3d14302c548c25accd2326650e"),
        (5, "da128e48cf98e44b5c44ee75f31017ceeb720f372972a2a44e87cbcaadc03cc7cf631315476fc492a2d5029caf7af9ca"),
        (6, "e254f625c9b7377f0f89d752144ffe00a0f6b13c736b0eff0c446adcbe98e7069577853542304de703387403f3ba6aa8"),
        (7, "28cc92239ec280675bcf5be90601b9a0deaa5f3c95a3d8f87041d1bdc1f88ac4bca8efbfbf3c64fa9109fef1ad6be771"),
    ];
    let actual: Vec<(i64, String)> = baton_store::MIGRATOR
        .iter()
        .map(|m| (m.version, m.checksum.iter().map(|b| format!("{b:02x}")).collect()))
        .collect();
    for (version, checksum) in RELEASED {
        let found = actual.iter().find(|(v, _)| v == version).unwrap_or_else(|| panic!("migration {version} removed"));
        assert_eq!(&found.1, checksum, "migration {version} was edited after release; add a new migration instead");
    }
}

/// The app and the CLI (or several CLI runs) may open a history that does not exist yet at
/// the same moment; each must find it migrated once, never half-made by another.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_processes_opening_a_new_history_at_once_all_succeed() {
    for round in 0..5 {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("history.sqlite");
        let opens: Vec<_> = (0..8)
            .map(|_| {
                tokio::spawn({
                    let db = db.clone();
                    async move { Store::open(&db).await }
                })
            })
            .collect();
        for open in opens {
            let store = open.await.expect("task").unwrap_or_else(|e| panic!("round {round}: {e}"));
            store.close().await;
        }
        let raw = sqlx::SqlitePool::connect(&format!("sqlite://{}", db.display())).await.expect("raw connection");
        let applied: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM _sqlx_migrations").fetch_one(&raw).await.expect("count");
        raw.close().await;
        assert_eq!(applied, baton_store::MIGRATOR.iter().count() as i64, "each migration applied once");
    }
}

#[tokio::test]
async fn a_database_from_before_reruns_is_upgraded_and_keeps_its_runs() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("old.sqlite");
    {
        // The schema as the first release left it, with a run in it.
        let options = sqlx::sqlite::SqliteConnectOptions::new().filename(&path).create_if_missing(true);
        let db = sqlx::SqlitePool::connect_with(options).await.expect("connect");
        baton_store::MIGRATOR.run_to(1, &db).await.expect("migration 1");
        sqlx::query("INSERT INTO conversations (id, title, created_at, updated_at) VALUES (1, 'old', 0, 0)")
            .execute(&db)
            .await
            .expect("conversation");
        sqlx::query(
            "INSERT INTO runs (id, uid, conversation_id, question, workers, status, started_at, answer)
             VALUES (1, 'u1', 1, 'Old question?', '[]', 'finished', 0, 'Old answer.')",
        )
        .execute(&db)
        .await
        .expect("run");
        db.close().await;
    }
    let store = Store::open(&path).await.expect("opens and upgrades");
    let tree = store.run(1).await.expect("query").expect("the old run");
    assert_eq!(tree.run.answer.as_deref(), Some("Old answer."));
    assert_eq!(tree.run.rerun_of, None);
    assert_eq!(store.search("old", 10).await.expect("search").len(), 1);
    let old = &store.list_conversations(10, None).await.expect("list")[0];
    assert_eq!((old.workers.as_deref(), old.review), (None, false), "all workers, no review");
}

/// A history made before accounting was split by caller (migration 3) opens: its runs keep
/// their flat totals and have no split; a run recorded afterwards has both.
#[tokio::test]
async fn a_database_from_before_the_accounting_split_is_upgraded() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("old.sqlite");
    {
        let options = sqlx::sqlite::SqliteConnectOptions::new().filename(&path).create_if_missing(true);
        let db = sqlx::SqlitePool::connect_with(options).await.expect("connect");
        baton_store::MIGRATOR.run_to(3, &db).await.expect("migrations 1-3");
        sqlx::query("INSERT INTO conversations (id, title, created_at, updated_at) VALUES (1, 'old', 0, 0)")
            .execute(&db)
            .await
            .expect("conversation");
        sqlx::query(
            "INSERT INTO runs (id, uid, conversation_id, question, workers, status, started_at, answer,
                               calls, input_tokens, output_tokens, cost_usd, cost_complete)
             VALUES (1, 'u1', 1, 'Old question?', '[]', 'finished', 0, 'Old answer.', 3, 120, 40, 0.5, 1)",
        )
        .execute(&db)
        .await
        .expect("run");
        db.close().await;
    }
    let server = TestServer::start().await.expect("server");
    let pool = pool(&server, &[("physicist", "phys"), ("teacher", "teach"), ("judge", "judge")]);
    let store = Store::open(&path).await.expect("opens and upgrades");
    let old = store.run(1).await.expect("query").expect("the old run");
    assert_eq!((old.run.calls, old.run.input_tokens, old.run.output_tokens), (3, 120, 40));
    assert_eq!(old.run.totals, None, "no split was recorded for it");

    let new = run_recorded(&store, &pool, Some(1), "Why is the sky blue?", FANOUT).await;
    let tree = store.run(new).await.expect("query").expect("the new run");
    let totals = tree.run.totals.expect("the split is recorded");
    assert_eq!(totals.calls as i64, tree.run.calls);
    assert_eq!((totals.workers.calls, totals.conductor.calls), (3, 0), "a given plan: no conductor calls");
    assert_eq!(totals.usage.input_tokens as i64, tree.run.input_tokens);
    let step_inputs: i64 = tree.steps.iter().filter_map(|s| s.input_tokens).sum();
    assert_eq!(step_inputs, tree.run.input_tokens, "the steps add up to the run");
    assert!(tree.steps.iter().all(|s| s.cached_input_tokens == Some(0)), "recorded, and none cached here");
}
