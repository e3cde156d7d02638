//! `baton keys` and keychain-held keys end to end: the binary against the real Secret Service
//! (the private gnome-keyring scripts/test starts) and against a machine with no keychain at all.

use std::path::Path;

use baton_tests::{Output, TEST_KEY, arg as path, fixture, private_keychain};
use baton_testserver::{Options, TestServer, Wire};
use serde_json::Value;

/// Runs the `baton` binary with `stdin` piped in and `env` on top of this process's environment
/// (which carries the test session's D-Bus address); `None` removes a variable.
async fn baton(args: &[&str], stdin: Option<&str>, env: &[(&str, Option<&str>)]) -> Output {
    baton_tests::run_with(Path::new(env!("CARGO_BIN_EXE_baton")), args, stdin, env).await
}

fn json_lines(stdout: &str) -> Vec<Value> {
    stdout.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect()
}

fn entry<'a>(lines: &'a [Value], account: &str) -> &'a Value {
    lines.iter().find(|l| l["account"] == account).unwrap_or_else(|| panic!("no {account} in {lines:?}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn without_a_keychain_keys_fail_with_exit_1_and_say_what_is_missing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing_pool = dir.path().join("none.toml");
    let no_bus = [("DBUS_SESSION_BUS_ADDRESS", Some("unix:path=/nonexistent"))];

    let out = baton(&["keys", "list", "--pool", path(&missing_pool)], None, &no_bus).await;
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    assert!(out.stdout.is_empty(), "{}", out.stdout);
    for needle in [
        "no OS keychain is available: no Secret Service could be reached over the D-Bus session bus",
        "/nonexistent",
        "apt install gnome-keyring",
        "KeePassXC",
        "api_key_env",
    ] {
        assert!(out.stderr.contains(needle), "{needle}: {}", out.stderr);
    }

    let set = baton(&["keys", "set", "openai"], Some("sk-never-stored-0123456789\n"), &no_bus).await;
    assert_eq!(set.code, Some(1), "{}", set.stderr);
    assert!(set.stderr.contains("api_key_env") && !set.stderr.contains("sk-never-stored"), "{}", set.stderr);

    // Outside any desktop session there is no bus address at all; zbus then tries a socket in
    // XDG_RUNTIME_DIR, here an empty directory so that no real session bus can answer.
    let unset = [("DBUS_SESSION_BUS_ADDRESS", None), ("XDG_RUNTIME_DIR", Some(path(dir.path())))];
    let out = baton(&["keys", "delete", "gemini"], None, &unset).await;
    assert_eq!(out.code, Some(1), "{}", out.stderr);
    assert!(out.stderr.contains("DBUS_SESSION_BUS_ADDRESS is unset, so there is no D-Bus session"), "{}", out.stderr);
    assert!(out.stderr.contains("api_key_env"), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_targets_are_bad_input_with_the_valid_names() {
    let unknown = baton(&["keys", "set", "openia"], Some("sk-0123456789abcdef\n"), &[]).await;
    assert_eq!(unknown.code, Some(2), "{}", unknown.stderr);
    assert!(
        unknown
            .stderr
            .contains("unknown provider \"openia\"; valid providers: openai, anthropic, gemini, openai-compatible"),
        "{}",
        unknown.stderr
    );
    let no_url = baton(&["keys", "delete", "openai-compatible"], None, &[]).await;
    assert_eq!(no_url.code, Some(2), "{}", no_url.stderr);
    assert!(no_url.stderr.contains("--base-url"), "{}", no_url.stderr);
    let local = baton(&["keys", "set", "local"], Some("x\n"), &[]).await;
    assert_eq!(local.code, Some(2), "{}", local.stderr);
    // There is no way to pass the key as an argument.
    let as_arg = baton(&["keys", "set", "openai", "sk-on-the-command-line"], None, &[]).await;
    assert_eq!(as_arg.code, Some(2), "{}", as_arg.stderr);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_piped_key_is_stored_listed_by_its_last_four_characters_and_deleted() {
    if !private_keychain() {
        return;
    }
    let key = "sk-cli-roundtrip-0123456789-abcd";
    let dir = tempfile::tempdir().expect("tempdir");
    let missing_pool = dir.path().join("none.toml");
    let pool = dir.path().join("pool.toml");
    std::fs::write(
        &pool,
        "[[worker]]\nname = \"gpt\"\nprovider = \"openai\"\nmodel = \"gpt-5\"\napi_key_env = \"BATON_KEYS_TEST_UNSET\"\n\
         [[worker]]\nname = \"vllm\"\nprovider = \"openai-compatible\"\nmodel = \"m\"\nbase_url = \"http://127.0.0.1:9/v1/\"\n",
    )
    .expect("write pool");

    let empty = baton(&["keys", "set", "openai"], Some("\n"), &[]).await;
    assert_eq!(empty.code, Some(2), "{}", empty.stderr);
    assert!(empty.stderr.contains("no key given"), "{}", empty.stderr);

    let set = baton(&["keys", "set", "openai"], Some(&format!("{key}\n")), &[]).await;
    assert_eq!(set.code, Some(0), "{}", set.stderr);
    assert_eq!(set.stdout, "stored the openai key (…abcd)\n");

    let list = baton(&["keys", "list", "--json", "--pool", path(&missing_pool)], None, &[]).await;
    assert_eq!(list.code, Some(0), "{}", list.stderr);
    let lines = json_lines(&list.stdout);
    assert_eq!(
        lines.iter().map(|l| l["account"].as_str().expect("account")).collect::<Vec<_>>(),
        ["openai", "anthropic", "gemini"]
    );
    assert_eq!(entry(&lines, "openai")["stored"], true);
    assert_eq!(entry(&lines, "openai")["last4"], "abcd");

    // With a pool: its OpenAI-compatible servers are listed, and api_key_env overrides shown.
    let with_pool = baton(&["keys", "list", "--json", "--pool", path(&pool)], None, &[]).await;
    assert_eq!(with_pool.code, Some(0), "{}", with_pool.stderr);
    let lines = json_lines(&with_pool.stdout);
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert_eq!(
        entry(&lines, "openai")["overridden_by"],
        serde_json::json!([{"worker": "gpt", "env": "BATON_KEYS_TEST_UNSET", "env_set": false, "env_allowed": false}])
    );
    assert_eq!(entry(&lines, "openai-compatible:http://127.0.0.1:9/v1")["stored"], false);
    let text = baton(&["keys", "list", "--pool", path(&pool)], None, &[]).await;
    assert_eq!(text.code, Some(0), "{}", text.stderr);
    assert!(text.stdout.contains("stored (…abcd)"), "{}", text.stdout);
    assert!(text.stdout.contains("worker \"gpt\" uses $BATON_KEYS_TEST_UNSET instead"), "{}", text.stdout);

    for out in [&set, &list, &with_pool, &text] {
        assert!(!out.stdout.contains(key) && !out.stderr.contains(key), "the key leaked: {out:?}");
        assert!(!out.stdout.contains("0123456789"), "more than the last four shown: {out:?}");
    }

    let delete = baton(&["keys", "delete", "openai"], None, &[]).await;
    assert_eq!(delete.code, Some(0), "{}", delete.stderr);
    assert_eq!(delete.stdout, "deleted the openai key\n");
    let again = baton(&["keys", "delete", "openai"], None, &[]).await;
    assert_eq!(again.stdout, "no openai key was stored\n");

    let list = baton(&["keys", "list", "--json", "--pool", path(&missing_pool)], None, &[]).await;
    assert_eq!(list.code, Some(0), "{}", list.stderr);
    let lines = json_lines(&list.stdout);
    assert_eq!(entry(&lines, "openai")["stored"], false);
    assert_eq!(entry(&lines, "openai")["last4"], Value::Null);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_worker_without_api_key_env_gets_its_key_from_the_keychain() {
    if !private_keychain() {
        return;
    }
    let s = TestServer::start_with(Options { key: Some(TEST_KEY.into()), ..Options::default() }).await.expect("server");
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = dir.path().join("pool.toml");
    let mut text = "[retry]\ninitial_delay_ms = 10\nmax_delay_ms = 100\n".to_owned();
    for name in ["first", "second", "third"] {
        text.push_str(&format!(
            "\n[[worker]]\nname = \"{name}\"\nprovider = \"anthropic\"\nmodel = \"{name}\"\nbase_url = \"{}\"\n",
            s.base_url(Wire::Anthropic)
        ));
    }
    std::fs::write(&pool, text).expect("write pool");
    let plan = fixture("chain-plan.txt");
    let db = dir.path().join("history.sqlite");
    let ask = ["ask", "--pool", path(&pool), "--plan", path(&plan), "--db", path(&db), "What is 2+2?"];

    // The workers' base_url is the loopback server, not Anthropic's host: the key a plain
    // `keys set anthropic` stores is not sent there.
    let url = s.base_url(Wire::Anthropic);
    let account = format!("anthropic:{}", url.trim_end_matches('/'));
    let set = baton(&["keys", "set", "anthropic"], Some(&format!("{TEST_KEY}\n")), &[]).await;
    assert_eq!(set.code, Some(0), "{}", set.stderr);
    let out = baton(&ask, None, &[]).await;
    assert_ne!(out.code, Some(0), "{}", out.stderr);
    assert!(out.stderr.contains(&format!("no anthropic key: run `baton keys set {account}`")), "{}", out.stderr);
    assert_eq!(s.requests().len(), 0, "Anthropic's key went to another host");
    let delete = baton(&["keys", "delete", "anthropic"], None, &[]).await;
    assert_eq!(delete.code, Some(0), "{}", delete.stderr);

    let set = baton(&["keys", "set", "anthropic", "--base-url", &url], Some(&format!("{TEST_KEY}\n")), &[]).await;
    assert_eq!(set.code, Some(0), "{}", set.stderr);
    let out = baton(&ask, None, &[]).await;
    assert_eq!(out.code, Some(0), "{}", out.stderr);
    assert_eq!(out.stdout, "third (saw 2 earlier answers) answers: What is 2+2?\n");
    assert_eq!(s.requests().len(), 3, "every step reached the server with the stored key");
    assert!(!out.stdout.contains(TEST_KEY) && !out.stderr.contains(TEST_KEY));
    // Nor did the key go into the history: the database, its WAL, its lock files.
    for entry in std::fs::read_dir(dir.path()).expect("dir").flatten().filter(|e| e.path().is_file()) {
        let bytes = std::fs::read(entry.path()).expect("read");
        assert!(!bytes.windows(TEST_KEY.len()).any(|w| w == TEST_KEY.as_bytes()), "{:?} holds the key", entry.path());
    }

    // The key is read per request: once it is deleted, the next run has none and says how to
    // store one.
    let delete = baton(&["keys", "delete", &account], None, &[]).await;
    assert_eq!(delete.code, Some(0), "{}", delete.stderr);
    let out = baton(&ask, None, &[]).await;
    assert_ne!(out.code, Some(0), "{}", out.stderr);
    assert!(
        out.stderr
            .contains(&format!("no anthropic key: run `baton keys set {account}` or set api_key_env in the pool")),
        "{}",
        out.stderr
    );
    assert_eq!(s.requests().len(), 3, "no request went out without a key");
}

/// A pool file (often someone else's) names a variable and a server: the variable's key goes
/// there only once the user has allowed that pairing, for workers and the conductor alike. The
/// refusal prints the one command that allows it; the keychain keeps the consent; without a
/// keychain, `BATON_ALLOW_KEY_ENV` says it instead.
#[tokio::test(flavor = "multi_thread")]
async fn a_pool_s_variable_goes_only_to_a_server_the_user_allowed() {
    if !private_keychain() {
        return;
    }
    let s = TestServer::start_with(Options { key: Some(TEST_KEY.into()), ..Options::default() }).await.expect("server");
    let url = s.base_url(Wire::OpenAi);
    let origin = url.trim_end_matches("/v1").to_owned();
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = dir.path().join("pool.toml");
    std::fs::write(
        &pool,
        format!(
            "[[worker]]\nname = \"theirs\"\nprovider = \"openai-compatible\"\nmodel = \"m\"\nbase_url = \"{url}\"\n\
             api_key_env = \"BATON_E2E_KEY\"\n"
        ),
    )
    .expect("write pool");
    let plan = dir.path().join("plan.txt");
    std::fs::write(&plan, "model_id = [0]\nsubtasks = ['Answer.']\naccess_list = [[]]\n").expect("plan");
    let ask = ["ask", "--pool", path(&pool), "--plan", path(&plan), "What is 2+2?"];
    // The consent the test helpers give as the user would is taken away: this user never gave it.
    let unallowed: &[(&str, Option<&str>)] = &[("BATON_E2E_KEY", Some(TEST_KEY)), ("BATON_ALLOW_KEY_ENV", None)];
    let command = format!("`baton keys allow-env BATON_E2E_KEY {origin}`");

    let refused = baton(&ask, None, unallowed).await;
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert!(refused.stderr.contains("worker \"theirs\" would send the key in the environment variable BATON_E2E_KEY"));
    assert!(refused.stderr.contains(&command), "{}", refused.stderr);
    assert_eq!(s.requests().len(), 0, "nothing went to the server");
    let listed = baton(&["keys", "list", "--json", "--pool", path(&pool)], None, unallowed).await;
    let lines = json_lines(&listed.stdout);
    assert_eq!(entry(&lines, &format!("openai-compatible:{url}"))["overridden_by"][0]["env_allowed"], false);

    // A conductor of theirs is held to the same.
    let conducted = dir.path().join("conducted.toml");
    std::fs::write(
        &conducted,
        format!(
            "[conductor]\nurl = \"{url}\"\nmodel = \"planner\"\napi_key_env = \"BATON_E2E_KEY\"\n\n\
             [[worker]]\nname = \"w\"\nprovider = \"openai-compatible\"\nmodel = \"m\"\nbase_url = \"{url}\"\n"
        ),
    )
    .expect("write pool");
    let plan_only = baton(&["plan", "--pool", path(&conducted), "Q"], None, unallowed).await;
    assert_eq!(plan_only.code, Some(2), "{}", plan_only.stderr);
    assert!(plan_only.stderr.contains("the conductor would send the key") && plan_only.stderr.contains(&command));
    assert_eq!(s.requests().len(), 0, "nothing went to the conductor's server");

    // The printed command, run as printed, allows exactly that pairing.
    let allow = baton(&["keys", "allow-env", "BATON_E2E_KEY", &url], None, &[]).await;
    assert_eq!(allow.code, Some(0), "{}", allow.stderr);
    let answered = baton(&ask, None, unallowed).await;
    assert_eq!(answered.code, Some(0), "{}", answered.stderr);
    assert_eq!(s.requests().len(), 1);
    let listed = baton(&["keys", "list", "--json", "--pool", path(&pool)], None, unallowed).await;
    let lines = json_lines(&listed.stdout);
    assert_eq!(entry(&lines, &format!("openai-compatible:{url}"))["overridden_by"][0]["env_allowed"], true);
    // Another variable, or another port on the same host, is another pairing.
    let other = std::fs::read_to_string(&pool).expect("pool").replace("BATON_E2E_KEY", "PATH");
    std::fs::write(&pool, other).expect("write pool");
    let refused = baton(&ask, None, unallowed).await;
    assert!(refused.stderr.contains("allow-env PATH"), "{}", refused.stderr);
    let moved = std::fs::read_to_string(&pool)
        .expect("pool")
        .replace("PATH", "BATON_E2E_KEY")
        .replace(&origin, &format!("http://127.0.0.1:{}", s.addr().port().wrapping_add(1).max(1)));
    std::fs::write(&pool, &moved).expect("write pool");
    let refused = baton(&ask, None, unallowed).await;
    assert_eq!(refused.code, Some(2), "{}", refused.stderr);
    assert_eq!(s.requests().len(), 1, "nothing more was sent");

    // Withdrawn, it is refused again; the environment can say it where there is no keychain.
    let back = moved.replace(&format!("http://127.0.0.1:{}", s.addr().port().wrapping_add(1).max(1)), &origin);
    std::fs::write(&pool, back).expect("write pool");
    let forbid = baton(&["keys", "forbid-env", "BATON_E2E_KEY", &origin], None, &[]).await;
    assert_eq!(forbid.code, Some(0), "{}", forbid.stderr);
    assert_eq!(baton(&ask, None, unallowed).await.code, Some(2));
    let allowed_by_env = format!("BATON_E2E_KEY={origin}");
    let answered =
        baton(&ask, None, &[("BATON_E2E_KEY", Some(TEST_KEY)), ("BATON_ALLOW_KEY_ENV", Some(&allowed_by_env))]).await;
    assert_eq!(answered.code, Some(0), "{}", answered.stderr);
    assert_eq!(s.requests().len(), 2);

    // The well-known variables need no consent for their official host, and allowing one is said
    // to be needless.
    let needless = baton(&["keys", "allow-env", "OPENAI_API_KEY", "https://api.openai.com/v1"], None, &[]).await;
    assert_eq!(needless.code, Some(0), "{}", needless.stderr);
    assert!(needless.stdout.contains("nothing to allow"), "{}", needless.stdout);
    let bad = baton(&["keys", "allow-env", "sk-0123456789abcdef", &url], None, &[]).await;
    assert_eq!(bad.code, Some(2), "{}", bad.stderr);
    assert!(!bad.stderr.contains("sk-0123456789abcdef"), "a key given by mistake is not echoed");
}
