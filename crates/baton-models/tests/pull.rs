//! Pulls against a loopback hub that speaks the hub's file protocol (`baton_testserver::hub`):
//! what lands where, resuming, stopping, and every refusal.

use std::time::Duration;

use baton_models::{Cache, Hub, ModelRef, Phase, Progress, PullError};
use baton_testserver::hub::{COMMIT, HubOptions, TestHub};
use tokio_util::sync::CancellationToken;

fn payload(len: usize) -> Vec<u8> {
    // Not all one byte, so a misplaced range shows in the hash.
    (0..len).map(|i| (i * 7 + i / 251) as u8).collect()
}

async fn pull(hub: &Hub, cache: &Cache, r: &ModelRef) -> (Result<baton_models::Pulled, PullError>, Vec<Progress>) {
    let mut seen = Vec::new();
    let result = hub.pull(cache, r, &mut |p| seen.push(p), &CancellationToken::new()).await;
    (result, seen)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_file_behind_a_renamed_repository_and_a_small_git_file_both_arrive() {
    let server = TestHub::start(HubOptions::default()).await.unwrap();
    let big = payload(300_000);
    let sha = server.add("acme/new-name", "m.gguf", big.clone());
    server.add_small("acme/new-name", "config.json", &b"{\"a\": 1}"[..]);
    server.rename("acme/old-name", "acme/new-name");
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::new(dir.path());
    let hub = Hub::new(&server.endpoint(), None);

    // The user names the old repository; the hub's relative redirect leads to the new one.
    let r = ModelRef::parse("acme/old-name:m.gguf").unwrap();
    let (pulled, progress) = pull(&hub, &cache, &r).await;
    let pulled = pulled.unwrap();
    assert_eq!(std::fs::read(&pulled.path).unwrap(), big);
    assert_eq!(pulled.sha256.as_deref(), Some(sha.as_str()));
    assert_eq!((pulled.size, pulled.fetched, pulled.resumed_from, pulled.cached), (300_000, 300_000, 0, false));
    assert_eq!(pulled.commit, COMMIT);
    assert_eq!(progress.first().map(|p| p.phase), Some(Phase::Resolving));
    assert_eq!(progress.last(), Some(&Progress { phase: Phase::Downloading, done: 300_000, total: 300_000 }));

    let small = ModelRef::parse("acme/new-name:config.json").unwrap();
    let (pulled, _) = pull(&hub, &cache, &small).await;
    let pulled = pulled.unwrap();
    assert_eq!(std::fs::read(&pulled.path).unwrap(), b"{\"a\": 1}");
    assert_eq!(pulled.sha256, None, "a git file's ETag is not a SHA-256; its size is what is checked");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_stopped_pull_keeps_its_bytes_and_the_next_one_fetches_only_the_rest() {
    let server = TestHub::start(HubOptions { chunk: 16 * 1024, ..HubOptions::default() }).await.unwrap();
    let data = payload(1_000_000);
    server.add("acme/m", "m.gguf", data.clone());
    server.set_chunk_delay(Duration::from_millis(5));
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::new(dir.path());
    let hub = Hub::new(&server.endpoint(), None);
    let r = ModelRef::parse("acme/m:m.gguf").unwrap();

    let stop = CancellationToken::new();
    let stopper = stop.clone();
    let mut on_progress = move |p: Progress| {
        if p.phase == Phase::Downloading && p.done >= 300_000 {
            stopper.cancel();
        }
    };
    let e = hub.pull(&cache, &r, &mut on_progress, &stop).await.unwrap_err();
    let PullError::Cancelled { have, size } = e else { panic!("{e}") };
    assert!((300_000..1_000_000).contains(&have) && size == 1_000_000, "{have} of {size}");
    let listed = cache.list().unwrap();
    assert_eq!(listed.len(), 1);
    assert!(!listed[0].complete && listed[0].bytes == have, "{listed:?}");

    server.set_chunk_delay(Duration::ZERO);
    let (pulled, progress) = pull(&hub, &cache, &r).await;
    let pulled = pulled.unwrap();
    assert_eq!(std::fs::read(&pulled.path).unwrap(), data);
    assert_eq!((pulled.resumed_from, pulled.fetched), (have, 1_000_000 - have));
    assert!(
        progress.contains(&Progress { phase: Phase::Checking, done: have, total: have }),
        "the part on disk is read back into the hash: {progress:?}"
    );
    let gets: Vec<_> = server.requests().into_iter().filter(|q| q.host == "files").collect();
    assert_eq!(gets.last().and_then(|q| q.range.clone()), Some(format!("bytes={have}-")));
    assert_eq!(gets.len(), 2);
    assert_eq!(gets[1].sent(), 1_000_000 - have, "the second transfer starts at the first byte not on disk");
    assert!(
        gets[0].sent() - have <= 8 * 16 * 1024,
        "sent twice: {} bytes in flight at the stop",
        gets[0].sent() - have
    );
    assert!(cache.list().unwrap().iter().all(|e| e.complete), "no partial file is left");

    // Pulled again: found in the cache, nothing fetched.
    let before = server.requests().len();
    let (again, _) = pull(&hub, &cache, &r).await;
    assert!(again.unwrap().cached);
    assert!(server.requests()[before..].iter().all(|q| q.host == "hub"), "only the metadata was asked for");
}

#[tokio::test(flavor = "multi_thread")]
async fn two_pulls_of_one_file_at_once_the_second_is_told_it_is_busy() {
    let server = TestHub::start(HubOptions::default()).await.unwrap();
    server.add("acme/m", "m.gguf", payload(2_000_000));
    server.set_chunk_delay(Duration::from_millis(10));
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::new(dir.path());
    let hub = Hub::new(&server.endpoint(), None);
    let r = ModelRef::parse("acme/m:m.gguf").unwrap();

    let (first_hub, first_cache, first_ref) = (hub.clone(), cache.clone(), r.clone());
    let first =
        tokio::spawn(
            async move { first_hub.pull(&first_cache, &first_ref, &mut |_| {}, &CancellationToken::new()).await },
        );
    // Until the first has its partial file open and locked.
    for _ in 0..200 {
        if cache.list().unwrap().iter().any(|e| !e.complete) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (second, _) = pull(&hub, &cache, &r).await;
    let e = second.unwrap_err();
    assert!(matches!(e, PullError::Busy { .. }), "{e}");
    assert!(e.to_string().contains("being downloaded already"), "{e}");
    assert!(first.await.unwrap().is_ok());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_connection_goes_on_from_the_last_byte_within_the_same_pull() {
    let server = TestHub::start(HubOptions::default()).await.unwrap();
    let data = payload(100_000);
    server.add("acme/m", "m.gguf", data.clone());
    server.cut_next_transfer_after(40_000);
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::new(dir.path());
    let hub = Hub::new(&server.endpoint(), None);
    let (pulled, progress) = pull(&hub, &cache, &ModelRef::parse("acme/m:m.gguf").unwrap()).await;
    assert_eq!(std::fs::read(pulled.unwrap().path).unwrap(), data);
    assert!(progress.iter().any(|p| p.phase == Phase::Reconnecting), "{progress:?}");
    let ranges: Vec<_> = server.requests().into_iter().filter(|q| q.host == "files").map(|q| q.range).collect();
    assert_eq!(ranges, vec![None, Some("bytes=40000-".to_owned())]);
    assert_eq!(server.file_bytes_sent(), 100_000, "a dropped connection sends nothing twice");
}
