//! `baton models` end to end: the real binary against a loopback Hugging Face hub (and its
//! separate file host) that speaks the hub's file protocol.

use std::path::Path;
use std::time::Duration;

use baton_tests::{Output, private_keychain};
use baton_testserver::hub::{COMMIT, HubOptions, TestHub};

const REPO: &str = "acme/Tiny-Conductor-GGUF";
const FILE: &str = "tiny-q4_k_m.gguf";

fn reference() -> String {
    format!("{REPO}:{FILE}")
}

fn payload(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + i / 997) as u8).collect()
}

/// `baton` with the hub at `endpoint`, models in `dir`, no token and no keychain unless `extra`
/// says otherwise.
async fn baton(dir: &Path, endpoint: &str, args: &[&str], extra: &[(&str, Option<&str>)]) -> Output {
    let models = dir.to_str().expect("utf-8");
    let mut env = vec![
        ("BATON_MODELS_DIR", Some(models)),
        ("HF_ENDPOINT", Some(endpoint)),
        ("HF_TOKEN", None),
        ("HUGGING_FACE_HUB_TOKEN", None),
        // No keychain to read a stored token from (one test sets up its own).
        ("DBUS_SESSION_BUS_ADDRESS", Some("unix:path=/nonexistent")),
    ];
    for (k, v) in extra {
        env.retain(|(name, _)| name != k);
        env.push((k, *v));
    }
    baton_tests::run_with(Path::new(env!("CARGO_BIN_EXE_baton")), args, None, &env).await
}

fn partial_len(dir: &Path) -> Option<u64> {
    let blobs = dir.join(format!("models--{}", REPO.replace('/', "--"))).join("blobs");
    std::fs::read_dir(blobs)
        .ok()?
        .flatten()
        .find(|e| e.file_name().to_string_lossy().ends_with(".incomplete"))
        .and_then(|e| e.metadata().ok())
        .map(|m| m.len())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pull_lands_in_the_hub_layout_verified_and_the_token_stays_with_the_hub() {
    let hub = TestHub::start(HubOptions::default()).await.unwrap();
    let data = payload(3_000_000);
    let sha = hub.add(REPO, FILE, data.clone());
    let dir = tempfile::tempdir().unwrap();
    let token = [("HF_TOKEN", Some("hf_test_token"))];

    let out = baton(dir.path(), &hub.endpoint(), &["models", "pull", &reference()], &token).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let path = out.stdout.trim().to_owned();
    let repo_dir = dir.path().join("models--acme--Tiny-Conductor-GGUF");
    assert_eq!(Path::new(&path), repo_dir.join("snapshots").join(COMMIT).join(FILE));
    assert_eq!(std::fs::read_link(&path).unwrap(), Path::new("../../blobs").join(&sha), "a relative link to the blob");
    assert_eq!(std::fs::read(&path).unwrap(), data);
    assert_eq!(std::fs::read_to_string(repo_dir.join("refs/main")).unwrap(), COMMIT);
    assert!(out.stderr.contains(&format!("SHA-256 {sha} checked")), "{}", out.stderr);
    assert!(out.stderr.contains("3.00 MB"), "{}", out.stderr);

    // The hub saw the token; the file host, another origin, never did.
    let requests = hub.requests();
    assert!(
        requests.iter().filter(|r| r.host == "hub").all(|r| r.authorization.as_deref() == Some("Bearer hf_test_token"))
    );
    let files: Vec<_> = requests.iter().filter(|r| r.host == "files").collect();
    assert_eq!(files.len(), 1);
    assert!(files.iter().all(|r| r.authorization.is_none()), "{files:?}");

    let out = baton(dir.path(), &hub.endpoint(), &["models", "path", &reference()], &[]).await;
    assert_eq!((out.code, out.stdout.trim()), (Some(0), path.as_str()), "{}", out.stderr);
    let out = baton(dir.path(), &hub.endpoint(), &["models", "list", "--json"], &[]).await;
    let listed: serde_json::Value = serde_json::from_str(out.stdout.trim()).expect("one JSON line");
    assert_eq!(listed["reference"]["repo"], REPO);
    assert_eq!((listed["complete"].as_bool(), listed["size"].as_u64()), (Some(true), Some(3_000_000)));

    // Again: found where it is, nothing downloaded.
    let out = baton(dir.path(), &hub.endpoint(), &["models", "pull", &reference()], &[]).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stderr.contains("already downloaded"), "{}", out.stderr);
    assert_eq!(hub.requests().iter().filter(|r| r.host == "files").count(), 1);

    let out = baton(dir.path(), &hub.endpoint(), &["models", "rm", &reference()], &[]).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(!repo_dir.exists());
    let out = baton(dir.path(), &hub.endpoint(), &["models", "path", &reference()], &[]).await;
    assert_eq!(out.code, Some(1));
    assert!(out.stderr.contains("is not downloaded") && out.stderr.contains("baton models pull"), "{}", out.stderr);
    let out = baton(dir.path(), &hub.endpoint(), &["models", "rm", &reference()], &[]).await;
    assert_eq!(out.code, Some(1), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pull_killed_half_way_resumes_and_the_hub_sends_at_most_one_chunk_twice() {
    const CHUNK: usize = 64 * 1024;
    let hub =
        TestHub::start(HubOptions { chunk: CHUNK, chunk_delay: Duration::from_millis(20), ..HubOptions::default() })
            .await
            .unwrap();
    let size = 4 * 1024 * 1024;
    let data = payload(size);
    hub.add(REPO, FILE, data.clone());
    let dir = tempfile::tempdir().unwrap();

    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["models", "pull", &reference()])
        .env("BATON_MODELS_DIR", dir.path())
        .env("HF_ENDPOINT", hub.endpoint())
        .env("DBUS_SESSION_BUS_ADDRESS", "unix:path=/nonexistent")
        .env("BATON_LOG_DIR", dir.path().join("logs"))
        .env_remove("HF_TOKEN")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut waited = 0;
    while partial_len(dir.path()).unwrap_or(0) < 1024 * 1024 {
        tokio::time::sleep(Duration::from_millis(5)).await;
        waited += 5;
        assert!(waited < 30_000, "the download reached 1 MiB within 30 s");
    }
    child.start_kill().unwrap(); // SIGKILL: no chance to tidy up
    child.wait().await.unwrap();
    let on_disk = partial_len(dir.path()).expect("the partial file stays");
    assert!(on_disk >= 1024 * 1024 && (on_disk as usize) < size, "{on_disk}");

    let out = baton(dir.path(), &hub.endpoint(), &["models", "list"], &[]).await;
    assert!(out.stdout.contains("partial:") && out.stdout.contains("resumes it"), "{}", out.stdout);

    hub.set_chunk_delay(Duration::ZERO);
    let out = baton(dir.path(), &hub.endpoint(), &["models", "pull", &reference()], &[]).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stderr.contains("resumed at"), "{}", out.stderr);
    assert_eq!(std::fs::read(out.stdout.trim()).unwrap(), data);

    let files: Vec<_> = hub.requests().into_iter().filter(|r| r.host == "files").collect();
    assert_eq!(files.len(), 2, "{files:?}");
    assert_eq!(files[1].range, Some(format!("bytes={on_disk}-")));
    let twice = hub.file_bytes_sent() - size as u64;
    eprintln!("bytes sent twice after a kill -9 at {on_disk}: {twice}");
    assert!(twice <= CHUNK as u64, "{twice} bytes were sent twice; at most one chunk ({CHUNK}) may be");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_corrupt_download_is_refused_and_deleted() {
    let hub = TestHub::start(HubOptions::default()).await.unwrap();
    let sha = hub.add(REPO, FILE, payload(500_000));
    hub.corrupt(REPO, FILE);
    let dir = tempfile::tempdir().unwrap();
    let out = baton(dir.path(), &hub.endpoint(), &["models", "pull", &reference()], &[]).await;
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    for needle in ["is corrupt", &format!("the hub lists {sha}"), "deleted; pull again"] {
        assert!(out.stderr.contains(needle), "{needle}: {}", out.stderr);
    }
    assert!(out.stdout.is_empty());
    let out = baton(dir.path(), &hub.endpoint(), &["models", "list", "--json"], &[]).await;
    assert_eq!(out.stdout, "", "nothing corrupt is kept");
}

#[tokio::test(flavor = "multi_thread")]
async fn gated_missing_unreachable_and_full_disk_each_say_what_to_do() {
    let hub = TestHub::start(HubOptions::default()).await.unwrap();
    hub.add(REPO, FILE, payload(10_000));
    hub.add("acme/Gated-GGUF", FILE, payload(10_000));
    hub.gate("acme/Gated-GGUF");
    let dir = tempfile::tempdir().unwrap();
    let endpoint = hub.endpoint();
    let failure = |out: &Output, code: i32, needles: &[&str]| {
        assert_eq!(out.code, Some(code), "{}", out.stderr);
        for needle in needles {
            assert!(out.stderr.contains(needle), "{needle}: {}", out.stderr);
        }
    };

    let gated = format!("acme/Gated-GGUF:{FILE}");
    let out = baton(dir.path(), &endpoint, &["models", "pull", &gated], &[]).await;
    failure(&out, 1, &["gated or private", "no access token was given", "HF_TOKEN", "baton keys set huggingface"]);
    let out = baton(dir.path(), &endpoint, &["models", "pull", &gated], &[("HF_TOKEN", Some("hf_wrong"))]).await;
    failure(&out, 1, &["the token given was refused", "Access to model acme/Gated-GGUF is restricted"]);
    let out = baton(dir.path(), &endpoint, &["models", "pull", &gated], &[("HF_TOKEN", Some("hf_test_token"))]).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);

    let out = baton(dir.path(), &endpoint, &["models", "pull", &format!("{REPO}:nope.gguf")], &[]).await;
    failure(&out, 1, &["nope.gguf was not found in acme/Tiny-Conductor-GGUF at main", "Files"]);
    let out = baton(dir.path(), &endpoint, &["models", "pull", "acme/nothing-here:m.gguf"], &[]).await;
    failure(&out, 1, &["the repository acme/nothing-here was not found on"]);
    let out = baton(dir.path(), &endpoint, &["models", "pull", &format!("{REPO}@v9:{FILE}")], &[]).await;
    failure(&out, 1, &["the revision \"v9\""]);
    let out = baton(dir.path(), &endpoint, &["models", "pull", "not-a-reference"], &[]).await;
    failure(&out, 2, &["REPO:FILE"]);

    // A port nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let out = baton(dir.path(), &dead, &["models", "pull", &reference()], &[]).await;
    failure(
        &out,
        1,
        &[&format!("cannot reach {dead}/{REPO}/resolve/main/{FILE}"), "HF_ENDPOINT", "a model file already on disk"],
    );

    // A file bigger than any disk: refused before a byte is fetched.
    hub.announce_size(REPO, FILE, 1 << 60);
    let before = hub.file_bytes_sent();
    let out = baton(dir.path(), &endpoint, &["models", "pull", &reference()], &[]).await;
    failure(&out, 1, &["not enough free disk space", "BATON_MODELS_DIR"]);
    assert_eq!(hub.file_bytes_sent(), before);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hub_token_stored_in_the_keychain_opens_a_gated_repository() {
    if !private_keychain() {
        return;
    }
    let hub = TestHub::start(HubOptions::default()).await.unwrap();
    hub.add("acme/Gated-GGUF", FILE, payload(10_000));
    hub.gate("acme/Gated-GGUF");
    let dir = tempfile::tempdir().unwrap();
    let endpoint = hub.endpoint();
    // The keychain of the test session (scripts/test's private one), not the dead bus above.
    let bus = std::env::var("DBUS_SESSION_BUS_ADDRESS").unwrap_or_default();
    let session = [("DBUS_SESSION_BUS_ADDRESS", Some(bus.as_str()))];
    let set = baton_tests::run_with(
        Path::new(env!("CARGO_BIN_EXE_baton")),
        &["keys", "set", "huggingface", "--base-url", &endpoint],
        Some("hf_test_token\n"),
        &session,
    )
    .await;
    assert_eq!(set.code, Some(0), "{}", set.stderr);
    assert!(set.stdout.contains(&format!("huggingface:{endpoint}")), "{}", set.stdout);
    let out = baton(dir.path(), &endpoint, &["models", "pull", &format!("acme/Gated-GGUF:{FILE}")], &session).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    let delete = baton_tests::run_with(
        Path::new(env!("CARGO_BIN_EXE_baton")),
        &["keys", "delete", "huggingface", "--base-url", &endpoint],
        None,
        &session,
    )
    .await;
    assert_eq!(delete.code, Some(0), "{}", delete.stderr);
}
