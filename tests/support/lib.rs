//! Shared support for tests that drive Baton's binaries: fixtures, pool files that point at a
//! loopback test server, and running a binary as a user would.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use baton_testserver::{TestServer, Wire};

/// The key the loopback servers expect in these tests. Distinctive, so a leak is easy to spot.
pub const TEST_KEY: &str = "sk-baton-test-7f3a9c1e5d";

/// The repository's `tests/fixtures` directory.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(name)
}

/// A worker line for [`write_pool`]: name, provider, model (with test-server directives).
#[derive(Debug)]
pub struct W<'a>(pub &'a str, pub &'a str, pub &'a str);

/// Writes a pool whose workers all talk to `server`; keys come from `$BATON_E2E_KEY`.
pub fn write_pool(dir: &Path, server: &TestServer, extra: &str, workers: &[W<'_>]) -> PathBuf {
    let mut text = format!("{extra}\n[retry]\ninitial_delay_ms = 10\nmax_delay_ms = 100\n");
    for W(name, provider, model) in workers {
        let wire = match *provider {
            "anthropic" => Wire::Anthropic,
            "gemini" => Wire::Gemini,
            _ => Wire::OpenAi,
        };
        text.push_str(&format!(
            "\n[[worker]]\nname = \"{name}\"\nprovider = \"{provider}\"\nmodel = \"{model}\"\nbase_url = \"{}\"\napi_key_env = \"BATON_E2E_KEY\"\n",
            server.base_url(wire)
        ));
    }
    let path = dir.join("pool.toml");
    std::fs::write(&path, text).expect("write pool");
    path
}

/// The consent a user who wrote the pool named by `args`' `--pool` gives: each variable the pool
/// names (`api_key_env`) may go to each server it names, as `BATON_ALLOW_KEY_ENV` says it.
/// Binaries run by these helpers get it, as their user would have allowed; the tests of that
/// consent remove the variable to see the refusal.
pub fn consent(args: &[&str]) -> Option<String> {
    let pool = args.iter().position(|a| *a == "--pool").and_then(|i| args.get(i + 1))?;
    let text = std::fs::read_to_string(pool).ok()?;
    let value = |line: &str, key: &str| -> Option<String> {
        let (name, rest) = line.split_once('=')?;
        (name.trim() == key).then(|| rest.trim().trim_matches('"').to_owned())
    };
    let vars: Vec<String> = text.lines().filter_map(|l| value(l, "api_key_env")).collect();
    let urls: Vec<String> = text.lines().filter_map(|l| value(l, "base_url").or_else(|| value(l, "url"))).collect();
    let pairs: Vec<String> = vars.iter().flat_map(|v| urls.iter().map(move |u| format!("{v}={u}"))).collect();
    (!pairs.is_empty()).then(|| pairs.join(" "))
}

/// A history database shared by the tests of one test binary, in a temporary directory of its
/// own (a static is never dropped, so the directory outlives the binary in the system temp dir).
fn test_history() -> PathBuf {
    static DIR: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("tempdir")).path().join("history.sqlite")
}

/// What a finished `baton` process left behind.
#[derive(Debug)]
pub struct Output {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs the binary `bin` with `args`, `stdin` and the test key in the environment.
pub async fn run(bin: &Path, args: &[&str], stdin: Option<&str>, key: &str) -> Output {
    run_with(bin, args, stdin, &[("BATON_E2E_KEY", Some(key))]).await
}

/// Runs the binary `bin` with `args`, `stdin`, and `env` on top of this process's environment
/// (`None` removes a variable).
pub async fn run_with(bin: &Path, args: &[&str], stdin: Option<&str>, env: &[(&str, Option<&str>)]) -> Output {
    run_within(Duration::from_secs(60), bin, args, stdin, env).await
}

/// Runs the binary `bin` with `args` and the test key, for up to two minutes: a command that
/// runs a whole evaluation or learning run over loopback workers.
pub async fn run_suite(bin: &Path, args: &[&str]) -> Output {
    run_within(Duration::from_secs(120), bin, args, None, &[("BATON_E2E_KEY", Some(TEST_KEY))]).await
}

/// Starts the binary `bin` with `args` and the test key, its output thrown away, for a test
/// that kills it part way; dropping the child kills it too.
pub fn spawn_quiet(bin: &Path, args: &[&str]) -> tokio::process::Child {
    spawn_with_stdout(bin, args, std::process::Stdio::null())
}

/// As [`spawn_quiet`], with its standard output going to `stdout` (`Stdio::piped()` to read
/// it as it comes); its errors are still thrown away.
pub fn spawn_with_stdout(bin: &Path, args: &[&str], stdout: std::process::Stdio) -> tokio::process::Child {
    let mut command = tokio::process::Command::new(bin);
    if let Some(allowed) = consent(args) {
        command.env("BATON_ALLOW_KEY_ENV", allowed);
    }
    command
        .args(args)
        .env("BATON_E2E_KEY", TEST_KEY)
        .env("BATON_KEEP_WARM", "0")
        .stdin(std::process::Stdio::null())
        .stdout(stdout)
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn")
}

/// `p` as a command-line argument.
pub fn arg(p: &Path) -> &str {
    p.to_str().expect("utf-8 path")
}

/// [`run_with`], for a command that may take up to `limit` (one that runs a real model).
pub async fn run_within(
    limit: Duration,
    bin: &Path,
    args: &[&str],
    stdin: Option<&str>,
    env: &[(&str, Option<&str>)],
) -> Output {
    let mut command = tokio::process::Command::new(bin);
    // Runs are recorded by default: into a history of the test process's own, never the
    // user's (a test's explicit --db or env entry wins over this).
    command.env("BATON_DB", test_history());
    // Logs likewise, beside that history.
    command.env("BATON_LOG_DIR", test_history().with_file_name("logs"));
    // Each command runs in its own process, as a test of the command expects (what it loads,
    // what it says while loading); the warm helper's own tests turn it on.
    command.env("BATON_KEEP_WARM", "0");
    if let Some(allowed) = consent(args) {
        command.env("BATON_ALLOW_KEY_ENV", allowed);
    }
    for (name, value) in env {
        match value {
            Some(value) => command.env(name, value),
            None => command.env_remove(name),
        };
    }
    let mut child = command
        .args(args)
        .env("NO_COLOR", "1")
        .env_remove("BATON_POOL")
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        use tokio::io::AsyncWriteExt;
        // A command that fails before reading its input closes the pipe; that is its answer.
        let _ = pipe.write_all(text.as_bytes()).await;
    }
    let out = tokio::time::timeout(limit, child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("finished within {limit:?}"))
        .expect("ran");
    Output {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A `baton serve` started as a user starts it, once it says where it listens.
#[derive(Debug)]
pub struct Serving {
    pub child: tokio::process::Child,
    /// `http://HOST:PORT/v1`, as the server said.
    pub url: String,
    /// The rest of what it says: kept open, since a server whose stderr is closed cannot write.
    pub stderr: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStderr>>,
}

impl Serving {
    /// Stops it as Ctrl-C does and waits for it; whether it ended well.
    pub async fn interrupt(mut self) -> std::process::ExitStatus {
        let pid = self.child.id().expect("running").to_string();
        std::process::Command::new("kill").args(["-INT", &pid]).status().expect("kill");
        tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await.expect("stops").expect("waited")
    }
}

/// Starts `bin serve ARGS` (`args` after `serve`) with `env` on top of this process's
/// environment, and waits up to `limit` for it to listen (a local model may load first).
pub async fn serve(bin: &Path, args: &[&str], env: &[(&str, &str)], limit: Duration) -> Serving {
    use tokio::io::AsyncBufReadExt;
    let mut command = tokio::process::Command::new(bin);
    command.env("BATON_DB", test_history()).env("BATON_LOG_DIR", test_history().with_file_name("logs"));
    if let Some(allowed) = consent(args) {
        command.env("BATON_ALLOW_KEY_ENV", allowed);
    }
    for (name, value) in env {
        command.env(name, value);
    }
    let mut child = command
        .arg("serve")
        .args(args)
        .env_remove("BATON_POOL")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn");
    let mut stderr = tokio::io::BufReader::new(child.stderr.take().expect("stderr")).lines();
    let url = tokio::time::timeout(limit, async {
        while let Some(line) = stderr.next_line().await.expect("stderr") {
            if let Some(rest) = line.strip_prefix("serving on ") {
                return rest.split_whitespace().next().expect("an address").to_owned();
            }
        }
        panic!("the server ended before it served");
    })
    .await
    .unwrap_or_else(|_| panic!("the server listens within {limit:?}"));
    Serving { child, url, stderr }
}

/// Whether the tests that store keys may run: only in the throwaway keyring `scripts/test`
/// starts (marked by `BATON_TEST_KEYRING=private`), never against one that may be the user's
/// own. Anything else fails, so a missing keychain cannot pass for a working one, unless the
/// user skips them with `BATON_SKIP_KEYCHAIN_TESTS=1`.
pub fn private_keychain() -> bool {
    if std::env::var("BATON_SKIP_KEYCHAIN_TESTS").is_ok_and(|v| v == "1") {
        eprintln!("keychain tests skipped (BATON_SKIP_KEYCHAIN_TESTS=1)");
        return false;
    }
    assert!(
        std::env::var_os("DBUS_SESSION_BUS_ADDRESS").is_some(),
        "no D-Bus session bus (DBUS_SESSION_BUS_ADDRESS is unset): run these tests through scripts/test, \
         which starts a private bus with a throwaway gnome-keyring, or set BATON_SKIP_KEYCHAIN_TESTS=1"
    );
    assert!(
        std::env::var("BATON_TEST_KEYRING").is_ok_and(|v| v == "private"),
        "refusing to write to what may be your own keyring: run these tests through scripts/test, which \
         starts a private bus with a throwaway gnome-keyring (and sets BATON_TEST_KEYRING=private), \
         or set BATON_SKIP_KEYCHAIN_TESTS=1"
    );
    true
}

/// The real model the behaviour tests run on: SmolLM2-135M-Instruct as a 98 MB Q4_1 GGUF,
/// fetched once by `scripts/fetch-test-model` into a cache outside the checkout (its SHA-256 is
/// checked on every call). `None` only outside CI when it cannot be fetched (no network): the
/// reason is printed past the test harness's capture, so a skip is never silent. Under CI
/// (`CI` set) a missing model fails the test instead.
pub fn real_model() -> Option<PathBuf> {
    static PATH: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    let found = PATH.get_or_init(|| {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("scripts").join("fetch-test-model");
        let out = std::process::Command::new(&script)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
        if !out.status.success() {
            return Err(format!("{} failed: {}", script.display(), String::from_utf8_lossy(&out.stderr).trim()));
        }
        Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
    });
    match found {
        Ok(path) => Some(path.clone()),
        Err(why) if std::env::var_os("CI").is_some() => panic!("the real test model is missing under CI: {why}"),
        Err(why) => {
            use std::io::Write;
            // Straight to the process's stderr: the harness captures eprintln! of passing tests.
            let _ = writeln!(std::io::stderr(), "SKIPPED: a test on the real model, which is not here: {why}");
            None
        }
    }
}

/// Runs `bin args` on an emulated CPU of `model` (QEMU's user-mode emulator, `-cpu Nehalem`
/// has no AVX), returning the exit code and stderr; `None` when the emulator is not installed
/// outside CI (the reason is printed). `scripts/setup` installs it.
pub fn run_on_emulated_cpu(model: &str, bin: &Path, args: &[&str]) -> Option<(Option<i32>, String)> {
    let out = match std::process::Command::new("qemu-x86_64").arg("-cpu").arg(model).arg(bin).args(args).output() {
        Ok(out) => out,
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("qemu-x86_64 (apt package qemu-user) is missing under CI: {e}")
        }
        Err(e) => {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "SKIPPED: a test on an emulated CPU: qemu-x86_64 (apt qemu-user): {e}");
            return None;
        }
    };
    Some((out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned()))
}
