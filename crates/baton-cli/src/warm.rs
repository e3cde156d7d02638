//! The warm helper. `baton ask` and `baton plan` load their local models (the conductor, local
//! workers) in a process of their own, so a question asked from the command line after another
//! would load them again and read the conductor's whole prompt cold. Instead, when a command
//! would load a model, it hands itself to a helper process that keeps the models loaded (and
//! the conductor's prompt cached) between questions, and exits once idle for a while.
//!
//! - **Which helper.** One per user, build of `baton` (its path, size and modification time)
//!   and environment (every variable but a terminal's own, such as `PWD` or `TERM`): a helper
//!   runs commands as the process that started it would, with the same keys, pool and history.
//!   Its socket is `$XDG_RUNTIME_DIR/baton/helper-<hash>.sock`, else under a directory of the
//!   temporary directory that only the user may enter.
//! - **The protocol.** Newline-delimited JSON on a Unix socket: the client sends the command's
//!   arguments, its working directory and (when the command reads it) its standard input; the
//!   helper answers with what the command writes to each stream and its exit code. Ctrl-C at the
//!   client, or the client going away, cancels the command in the helper, which records it as
//!   the command itself would.
//! - **Its life.** The client starts it (detached, in a process group of its own) when none
//!   answers, and says so. It runs one command at a time, drops models the next pool does not
//!   use and those whose file changed, and exits after `BATON_KEEP_WARM` seconds (300 when
//!   unset) without a command. `BATON_KEEP_WARM=0` runs every command in its own process.
//! - **Failures.** When no helper can be started or reached, the command runs in its own process
//!   after a warning; a helper that dies mid-command fails the command with what to do.

use std::ffi::OsString;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use baton_runner::LocalModels;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

use crate::io::{Io, Stream};
use crate::{Failure, Outcome};

/// How long a helper stays without a command when `BATON_KEEP_WARM` is unset.
const DEFAULT_IDLE: Duration = Duration::from_secs(300);

/// Environment variables that differ between terminals of one session and that no command
/// reads: a helper started from one terminal serves the others.
const TERMINAL_VARIABLES: &[&str] = &[
    "PWD",
    "OLDPWD",
    "SHLVL",
    "_",
    "COLUMNS",
    "LINES",
    "TERM",
    "COLORTERM",
    "TERM_PROGRAM",
    "TERM_PROGRAM_VERSION",
    "TERM_SESSION_ID",
    "WINDOWID",
    "TMUX_PANE",
    "GNOME_TERMINAL_SCREEN",
    "GNOME_TERMINAL_SERVICE",
    "VTE_VERSION",
    "KONSOLE_DBUS_SESSION",
    "KONSOLE_DBUS_WINDOW",
    "ITERM_SESSION_ID",
    "WT_SESSION",
    "SSH_TTY",
    "STY",
    "WINDOW",
    "PS1",
    "PROMPT_COMMAND",
    "TMUX",
    "SSH_CLIENT",
    "SSH_CONNECTION",
    "GPG_TTY",
    "KITTY_WINDOW_ID",
    "KITTY_PID",
    "WEZTERM_PANE",
    "ALACRITTY_WINDOW_ID",
    "STARSHIP_SESSION_KEY",
    "VSCODE_GIT_IPC_HANDLE",
    "VSCODE_INJECTION",
    "VSCODE_IPC_HOOK_CLI",
    // The client works these out itself: colour from its own terminal, the idle time when it
    // starts a helper.
    "NO_COLOR",
    "BATON_KEEP_WARM",
];

/// What the client sends first.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Request {
    /// The command line after `baton`.
    args: Vec<OsString>,
    cwd: PathBuf,
    /// The client's standard input, when the command reads it.
    stdin: Option<String>,
    /// Whether the client's error stream shows colour.
    color: bool,
}

/// What the client sends after its request.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
enum Control {
    /// The user pressed Ctrl-C.
    Cancel,
}

/// What the helper sends.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
enum Reply {
    /// The helper took the connection: the command will run.
    Hello {
        pid: u32,
    },
    Write {
        stream: Stream,
        text: String,
    },
    /// The command ended with this exit code.
    Exit {
        code: u8,
    },
}

/// `BATON_KEEP_WARM`: how long a helper stays idle, or `None` for no helper.
pub fn keep_warm() -> Result<Option<Duration>, Failure> {
    let Some(value) = std::env::var_os("BATON_KEEP_WARM") else { return Ok(Some(DEFAULT_IDLE)) };
    let value = value.to_string_lossy();
    match value.trim() {
        "0" | "off" | "no" | "false" => Ok(None),
        v => v.parse::<u64>().map(|s| Some(Duration::from_secs(s))).map_err(|_| {
            Failure::BadInput(format!(
                "BATON_KEEP_WARM={value}: expected the seconds a helper keeps the models loaded after a question \
                 (unset: {}), or 0 for no helper",
                DEFAULT_IDLE.as_secs()
            ))
        }),
    }
}

/// Runs the command (`args`, the command line after `baton`) in a warm helper, starting one if
/// none answers. `None` when it must run here instead (no helper could be reached; a warning
/// said why). `reads_stdin`: the command reads its standard input, which goes along.
pub async fn run_in_helper(args: Vec<OsString>, reads_stdin: bool, idle: Duration) -> Option<Outcome> {
    let socket = match socket_path() {
        Ok(s) => s,
        Err(why) => {
            eprintln!("warning: no warm helper ({why}); the models load in this process");
            return None;
        }
    };
    let stream = match connect_or_start(&socket, idle).await {
        Ok(stream) => stream,
        Err(why) => {
            eprintln!("warning: no warm helper ({why}); the models load in this process");
            return None;
        }
    };
    let stdin = if reads_stdin {
        match crate::io::Io::terminal().read_stdin() {
            Ok(text) => Some(text),
            Err(e) => return Some(Err(Failure::BadInput(format!("stdin: cannot read: {e}")))),
        }
    } else {
        None
    };
    let cwd = match std::env::current_dir() {
        Ok(cwd) => cwd,
        Err(e) => return Some(Err(Failure::Failed(format!("cannot tell the working directory: {e}")))),
    };
    let request = Request { args, cwd, stdin, color: crate::io::colored_stderr() };
    Some(converse(stream, &request).await)
}

/// Sends the request, relays the replies to this process's streams, and returns the command's
/// exit as an outcome.
async fn converse(stream: UnixStream, request: &Request) -> Outcome {
    let (read, mut write) = stream.into_split();
    let mut line = serde_json::to_string(request).map_err(|e| Failure::Failed(e.to_string()))?;
    line.push('\n');
    write.write_all(line.as_bytes()).await.map_err(|e| helper_lost(&e.to_string()))?;
    let mut replies = BufReader::new(read).lines();
    // One listener for the whole command: a Ctrl-C that comes while a reply is being written
    // out is then still seen (a listener made anew on each turn would miss it).
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(|e| Failure::Failed(format!("cannot listen for Ctrl-C: {e}")))?;
    let mut interrupted = false;
    loop {
        let next = tokio::select! {
            next = replies.next_line() => next,
            _ = sigint.recv() => {
                if interrupted {
                    // A second Ctrl-C does not wait for the helper to wind the command up
                    // (a model still loading, say): the helper finishes that on its own.
                    return Err(Failure::Interrupted);
                }
                interrupted = true;
                let mut cancel = serde_json::to_string(&Control::Cancel).unwrap_or_default();
                cancel.push('\n');
                // A helper that no longer reads has ended the command anyway.
                let _ = write.write_all(cancel.as_bytes()).await;
                continue;
            }
        };
        let line = match next {
            Ok(Some(line)) => line,
            Ok(None) => return Err(helper_lost("it closed the connection")),
            Err(e) => return Err(helper_lost(&e.to_string())),
        };
        match serde_json::from_str::<Reply>(&line) {
            Ok(Reply::Hello { .. }) => {}
            Ok(Reply::Write { stream: Stream::Out, text }) => {
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
            }
            Ok(Reply::Write { stream: Stream::Err, text }) => {
                let _ = std::io::stderr().lock().write_all(text.as_bytes());
            }
            // The helper has written the command's own error message already.
            Ok(Reply::Exit { code }) => return Err(Failure::Exited(code)),
            Err(e) => return Err(helper_lost(&format!("it sent something unexpected ({e})"))),
        }
    }
}

fn helper_lost(why: &str) -> Failure {
    Failure::Failed(format!(
        "the warm helper stopped before the command ended: {why}. Run it again (a new helper starts), or with \
         BATON_KEEP_WARM=0 to run it in this process; the helper's log is in `baton logs path`"
    ))
}

/// A connection to the helper for this build and environment, started if none answers.
async fn connect_or_start(socket: &Path, idle: Duration) -> Result<UnixStream, String> {
    // A helper about to exit idle may take the connection and close it: the Hello says that
    // this one will run the command.
    for _ in 0..2 {
        if let Ok(stream) = UnixStream::connect(socket).await
            && let Some((stream, pid)) = hello(stream).await
        {
            eprintln!("using the models kept loaded by baton's helper (pid {pid})");
            return Ok(stream);
        }
        let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
        let mut child = std::process::Command::new(&exe);
        child
            .arg("__keep-warm")
            .arg(socket)
            .arg(idle.as_secs().to_string())
            .current_dir("/")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        // Its own process group: Ctrl-C at the terminal stops the command, not the helper.
        std::os::unix::process::CommandExt::process_group(&mut child, 0);
        let mut child = child.spawn().map_err(|e| format!("cannot start {}: {e}", exe.display()))?;
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(20)).await;
            if let Ok(stream) = UnixStream::connect(socket).await
                && let Some((stream, pid)) = hello(stream).await
            {
                eprintln!(
                    "started baton's helper (pid {pid}): it keeps the models loaded for the next question and exits \
                     after {} s without one (BATON_KEEP_WARM=0: no helper)",
                    idle.as_secs()
                );
                return Ok(stream);
            }
            // One that lost a race to another starting helper exits; that other one answers.
            if let Ok(Some(status)) = child.try_wait()
                && !status.success()
                && started.elapsed() > Duration::from_secs(2)
            {
                return Err(format!("the helper exited ({status}); see its log in `baton logs path`"));
            }
        }
    }
    Err("the helper did not answer within 10 s".into())
}

/// Waits for the helper's Hello on a fresh connection.
async fn hello(stream: UnixStream) -> Option<(UnixStream, u32)> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    let read = tokio::time::timeout(Duration::from_secs(5), reader.read_line(&mut line)).await;
    match (read, serde_json::from_str::<Reply>(&line)) {
        (Ok(Ok(n)), Ok(Reply::Hello { pid })) if n > 0 => {
            // Nothing follows the Hello until the request is sent, so the buffer is empty.
            Some((reader.into_inner(), pid))
        }
        _ => None,
    }
}

/// The socket of the helper for this build of `baton`, this user and this environment.
fn socket_path() -> Result<PathBuf, String> {
    let dir = match std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from) {
        Some(dir) if dir.is_absolute() => dir.join("baton"),
        _ => std::env::temp_dir().join(format!("baton-{}", uid())),
    };
    private_dir(&dir)?;
    let path = dir.join(format!("helper-{:016x}.sock", identity()?));
    // A Unix socket's path has room for about 100 bytes.
    if path.as_os_str().len() > 100 {
        return Err(format!("{}: too long a path for a socket", path.display()));
    }
    Ok(path)
}

/// Makes `dir` if needed and checks that only this user may enter it.
fn private_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot make {}: {e}", dir.display())),
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if !meta.is_dir() || meta.uid() != uid() || meta.mode() & 0o077 != 0 {
        return Err(format!("{} is not a directory that only this user may enter", dir.display()));
    }
    Ok(())
}

fn uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    #[allow(unsafe_code)]
    unsafe {
        libc::getuid()
    }
}

/// A hash of this program's path, size and modification time, and of the environment but for
/// [`TERMINAL_VARIABLES`]: what decides how a command runs.
fn identity() -> Result<u64, String> {
    use std::os::unix::ffi::OsStrExt;
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let meta = std::fs::metadata(&exe).map_err(|e| format!("{}: {e}", exe.display()))?;
    let modified = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).unwrap_or_default();
    let mut hash = Fnv::default();
    hash.write(exe.as_os_str().as_bytes());
    hash.write(&meta.len().to_le_bytes());
    hash.write(&modified.as_nanos().to_le_bytes());
    let mut vars: Vec<(OsString, OsString)> =
        std::env::vars_os().filter(|(name, _)| !TERMINAL_VARIABLES.iter().any(|t| name.as_os_str() == *t)).collect();
    vars.sort();
    for (name, value) in vars {
        hash.write(name.as_bytes());
        hash.write(b"=");
        hash.write(value.as_bytes());
        hash.write(b"\0");
    }
    Ok(hash.0)
}

/// FNV-1a: stable across builds and platforms, unlike the standard library's hasher.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
}

/// `baton __keep-warm SOCKET IDLE_SECS`: the helper. Serves commands on `socket` until idle
/// for `idle`.
pub async fn serve(socket: PathBuf, idle: Duration) -> Outcome {
    use std::os::unix::fs::MetadataExt;
    let listener = bind(&socket).map_err(Failure::Failed)?;
    // The socket file this helper made: a helper that lost a race to bind it (both found a dead
    // one's socket and replaced it) sees another file there, and leaves without removing it.
    let inode = |path: &Path| std::fs::symlink_metadata(path).ok().map(|m| (m.dev(), m.ino()));
    let ours = inode(&socket);
    tracing::info!(socket = %socket.display(), idle_secs = idle.as_secs(), "the warm helper is listening");
    let models = Arc::new(LocalModels::default());
    // One command at a time: each runs in its client's working directory, and the models
    // are not shared between runs at once.
    let turn = Arc::new(tokio::sync::Mutex::new(()));
    let running = Arc::new(AtomicUsize::new(0));
    let mut last = Instant::now();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    last = Instant::now();
                    let (models, turn, running) = (models.clone(), turn.clone(), running.clone());
                    running.fetch_add(1, Ordering::SeqCst);
                    tokio::spawn(async move {
                        // Counted down even if the command panics, so the helper still exits idle.
                        let _running = Running(running);
                        if let Err(e) = handle(stream, &models, &turn).await {
                            tracing::warn!("a command's client went away: {e}");
                        }
                    });
                }
                Err(e) => tracing::warn!("cannot take a connection: {e}"),
            },
            () = tokio::time::sleep(Duration::from_secs(1)) => {
                if running.load(Ordering::SeqCst) > 0 {
                    last = Instant::now();
                } else if inode(&socket) != ours {
                    tracing::info!("the warm helper exits: its socket is gone or another helper's");
                    return Ok(());
                } else if last.elapsed() >= idle {
                    // Unlinked first, so that no client connects to a helper that is leaving.
                    let _ = std::fs::remove_file(&socket);
                    tracing::info!("the warm helper exits after {} s idle", last.elapsed().as_secs());
                    return Ok(());
                }
            }
        }
    }
}

/// One command under way in the helper, until dropped.
struct Running(Arc<AtomicUsize>);

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Puts the helper back in `/` when a command ends, however it ends: the helper holds no
/// directory of a client's open meanwhile.
struct BackToRoot;

impl Drop for BackToRoot {
    fn drop(&mut self) {
        let _ = std::env::set_current_dir("/");
    }
}

/// Listens on `socket`, taking the place of a helper that died without removing it.
fn bind(socket: &Path) -> Result<UnixListener, String> {
    match UnixListener::bind(socket) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            if std::os::unix::net::UnixStream::connect(socket).is_ok() {
                return Err(format!("{}: another helper is listening", socket.display()));
            }
            std::fs::remove_file(socket).map_err(|e| format!("{}: {e}", socket.display()))?;
            UnixListener::bind(socket).map_err(|e| format!("{}: {e}", socket.display()))
        }
        Err(e) => Err(format!("{}: {e}", socket.display())),
    }
}

/// Runs one client's command.
async fn handle(stream: UnixStream, models: &LocalModels, turn: &tokio::sync::Mutex<()>) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut hello = serde_json::to_string(&Reply::Hello { pid: std::process::id() })?;
    hello.push('\n');
    write.write_all(hello.as_bytes()).await?;
    let mut lines = BufReader::new(read).lines();
    let Some(line) = lines.next_line().await? else { return Ok(()) };
    let request: Request = serde_json::from_str(&line)?;

    // Replies go through a channel: the command writes from synchronous callbacks.
    let (send, mut replies) = tokio::sync::mpsc::unbounded_channel::<Reply>();
    let writer = tokio::spawn(async move {
        while let Some(reply) = replies.recv().await {
            let Ok(mut line) = serde_json::to_string(&reply) else { continue };
            line.push('\n');
            if write.write_all(line.as_bytes()).await.is_err() {
                break;
            }
        }
    });
    let cancel = CancellationToken::new();
    // Ctrl-C at the client, or the client gone: the command stops as it would on Ctrl-C.
    let watcher = {
        let cancel = cancel.clone();
        tokio::spawn(async move {
            loop {
                match lines.next_line().await {
                    Ok(Some(line)) if matches!(serde_json::from_str(&line), Ok(Control::Cancel)) => break,
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => break,
                }
            }
            cancel.cancel();
        })
    };
    let to_client = send.clone();
    let io = Io::remote(
        move |stream, text| {
            let _ = to_client.send(Reply::Write { stream, text: text.to_owned() });
        },
        request.stdin,
        request.color,
        cancel,
    );

    let code = match wait_for_turn(turn, &io).await {
        // Ctrl-C (or the client gone) while waiting: the command never starts, as a command
        // stopped before it began would not have.
        None => crate::report(Err(Failure::Interrupted), &io),
        Some(_turn) => {
            let changed = models.forget_changed_files();
            if !changed.is_empty() {
                tracing::info!(?changed, "models whose files changed are loaded again");
            }
            let _root = BackToRoot;
            match std::env::set_current_dir(&request.cwd) {
                Ok(()) => crate::run_command(request.args, &io, models).await,
                Err(e) => crate::report(
                    Err(Failure::BadInput(format!("{}: cannot work there: {e}", request.cwd.display()))),
                    &io,
                ),
            }
        }
    };
    let _ = send.send(Reply::Exit { code });
    drop(send);
    drop(io);
    watcher.abort();
    let _ = writer.await;
    Ok(())
}

/// The helper's one turn: commands run one at a time, since they share the loaded models and the
/// working directory. A command that has to wait says so; `None` when it is stopped while waiting.
async fn wait_for_turn<'a>(turn: &'a tokio::sync::Mutex<()>, io: &Io) -> Option<tokio::sync::MutexGuard<'a, ()>> {
    if let Ok(guard) = turn.try_lock() {
        return Some(guard);
    }
    io.err("waiting for the command that baton's helper is running to finish (BATON_KEEP_WARM=0: run apart)\n");
    tokio::select! {
        guard = turn.lock() => Some(guard),
        () = io.cancel.cancelled() => None,
    }
}
