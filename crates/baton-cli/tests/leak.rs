//! A distinctive key goes into requests and nowhere else: not the history database (its WAL
//! included), not the output, not the exports, not the log — even when a server echoes it in an error.

use baton_tests::{Output, W, fixture, write_pool};
use baton_testserver::{Options, TestServer};

const KEY: &str = "sk-baton-LEAK-canary-5c1e9a77d3b24f08";

/// Runs `baton` with `key` in the environment and its log files in `logs`.
async fn baton(args: &[&str], key: &str, logs: &std::path::Path) -> Output {
    let env = [("BATON_E2E_KEY", Some(key)), ("BATON_LOG_DIR", Some(path(logs)))];
    baton_tests::run_with(std::path::Path::new(env!("CARGO_BIN_EXE_baton")), args, None, &env).await
}

fn path(p: &std::path::Path) -> &str {
    p.to_str().expect("utf-8 path")
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[tokio::test(flavor = "multi_thread")]
async fn the_key_reaches_the_servers_and_nothing_else() {
    let good = TestServer::start_with(Options { key: Some(KEY.into()), ..Options::default() }).await.expect("server");
    // This one expects another key and, like some real servers, echoes the key it got.
    let echoing = TestServer::start_with(Options { key: Some("another-key".into()), ..Options::default() })
        .await
        .expect("server");
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("history.sqlite");
    // Inside `dir`: the log files are scanned with everything else below.
    let logs = dir.path().join("logs");
    let ok_pool =
        write_pool(dir.path(), &good, "", &[W("a", "openai", "a"), W("b", "anthropic", "b"), W("c", "gemini", "c")]);
    let ok_pool = {
        let p = dir.path().join("ok.toml");
        std::fs::rename(&ok_pool, &p).expect("rename");
        p
    };
    let bad_pool =
        write_pool(dir.path(), &echoing, "", &[W("a", "openai", "a"), W("b", "openai", "b"), W("c", "openai", "c")]);
    let plan = fixture("chain-plan.txt");

    let mut outputs = Vec::new();
    for (pool, json) in [(&ok_pool, false), (&ok_pool, true), (&bad_pool, false), (&bad_pool, true)] {
        let mut args = vec!["ask", "--pool", path(pool), "--plan", path(&plan), "--db", path(&db)];
        if json {
            args.push("--json");
        }
        args.push("Which key do you use?");
        outputs.push(baton(&args, KEY, &logs).await);
    }
    assert_eq!(outputs[0].code, Some(0), "{}", outputs[0].stderr);
    assert_eq!(outputs[2].code, Some(1), "the echoing server refuses the key: {}", outputs[2].stderr);
    // The key really went out, and really came back in an error body.
    assert!(good.requests().iter().all(|r| r.headers.values().any(|v| v.contains(KEY))));
    assert!(!echoing.requests().is_empty());

    for what in [&["history", "list"][..], &["history", "show", "1"], &["history", "show", "3", "--json"]] {
        let mut args = what.to_vec();
        args.extend(["--db", path(&db)]);
        outputs.push(baton(&args, "", &logs).await);
    }
    for (run, format) in [("1", "md"), ("3", "json"), ("4", "json")] {
        outputs.push(baton(&["history", "export", run, "--format", format, "--db", path(&db)], "", &logs).await);
    }
    let show_failed = &outputs[6];
    assert!(show_failed.stdout.contains("<redacted>"), "the echoed key was cut out: {}", show_failed.stdout);
    for (i, out) in outputs.iter().enumerate() {
        assert!(
            !out.stdout.contains(KEY) && !out.stderr.contains(KEY),
            "output {i} holds the key:\n{}\n{}",
            out.stdout,
            out.stderr
        );
    }
    // Every file the history wrote: the database, its WAL and shared memory, lock files.
    let mut files = 0;
    for entry in walk(dir.path()) {
        if entry.extension().is_some_and(|e| e == "toml") {
            continue;
        }
        let bytes = std::fs::read(&entry).expect("read");
        assert!(!contains(&bytes, KEY.as_bytes()), "{} holds the key", entry.display());
        files += 1;
    }
    assert!(files >= 1, "the database was written");
    // The log is there and tells of the failure the echoing server caused, without its key.
    let log: String = walk(&logs).iter().map(|f| std::fs::read_to_string(f).expect("read log")).collect();
    assert!(log.contains("run failed") && log.contains("<redacted>"), "the log tells what happened:\n{log}");
    // Each line about a run names it: on a server, the lines of runs at once interleave.
    let about_runs: Vec<&str> =
        log.lines().filter(|l| ["run ", "plan ", "step "].iter().any(|w| l.contains(&format!("logs: {w}")))).collect();
    assert!(!about_runs.is_empty(), "{log}");
    for line in about_runs {
        assert!(line.contains(" run="), "a line that names no run: {line}");
    }
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read dir").flatten() {
        let p = entry.path();
        if p.is_dir() { out.extend(walk(&p)) } else { out.push(p) }
    }
    out
}
