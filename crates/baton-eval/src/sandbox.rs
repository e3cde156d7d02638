//! Running model-written code, only inside a sandbox.
//!
//! A code item's program (the candidate, then the item's tests, then `check(entry_point)`) runs
//! as `python3 -I -B main.py` in a throwaway directory, in a process of its own with:
//!
//! - **limits** (`setrlimit` before `exec`): CPU seconds, address space (memory), the size of
//!   any file it writes, no core dumps; and a wall-clock limit after which its whole process
//!   group is killed;
//! - **OS isolation**, the strongest this machine allows, found once per process:
//!   1. `bwrap` (bubblewrap): new user, network, PID, IPC and UTS namespaces, the filesystem
//!      read-only except the throwaway directory, an empty `/tmp` and `$HOME`;
//!   2. else `unshare --user --net`: no network, the filesystem as the user sees it;
//!   3. else none;
//! - **a guard inside Python** in every case: an audit hook, installed before the candidate's
//!   first line and impossible to remove from Python, refuses sockets, writes, renames and
//!   deletions outside the directory, new processes and `ctypes`. It is what stops a write
//!   where no OS isolation exists, and a second wall where it does.
//!
//! A program that breaks a limit or trips the guard fails: the item is scored wrong with the
//! reason, and the evaluation goes on.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;

/// Limits for one program.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub cpu_secs: u64,
    pub wall: Duration,
    pub memory_bytes: u64,
    pub file_bytes: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { cpu_secs: 10, wall: Duration::from_secs(15), memory_bytes: 1 << 30, file_bytes: 16 << 20 }
    }
}

/// The OS isolation in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    Bubblewrap,
    NetworkNamespace,
    /// Only the Python guard and the limits.
    GuardOnly,
}

impl Isolation {
    pub fn describe(self) -> &'static str {
        match self {
            Isolation::Bubblewrap => "bubblewrap: no network, read-only filesystem but for a throwaway directory",
            Isolation::NetworkNamespace => {
                "a network namespace (no network); writes outside the directory refused by the Python guard"
            }
            Isolation::GuardOnly => {
                "no OS isolation available (install bubblewrap); network and writes refused by the Python guard only"
            }
        }
    }
}

/// What became of a program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub passed: bool,
    /// Why it did not pass, in a line: the exception, a limit, the guard.
    pub reason: Option<String>,
    pub wall_ms: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("code items need python3 on PATH ({0}); install Python 3.8 or newer")]
    NoPython(String),
    #[error("cannot prepare the sandbox: {0}")]
    Io(#[from] std::io::Error),
}

/// Written by a program once its tests have run to their end.
const CHECKED: &str = ".baton-checked";

/// Installed before the candidate's code. Audit hooks cannot be removed once added.
const GUARD: &str = r#"def _baton_guard():
    import os, sys
    # Everything the hook uses is bound here, so the candidate rebinding a builtin or patching
    # `os` later cannot switch it off.
    realpath, fsdecode, sep, PathLike = os.path.realpath, os.fsdecode, os.sep, os.PathLike
    root = realpath(os.getcwd())
    W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    # Path events, with the positions of their dir_fd arguments (a path relative to another
    # directory's descriptor could point anywhere: refused).
    paths = {"os.remove": (1,), "os.rename": (2, 3), "os.replace": (2, 3), "os.rmdir": (1,), "os.mkdir": (2,),
             "shutil.rmtree": (1,), "os.chmod": (2,), "os.chown": (3,), "os.symlink": (2,), "os.link": (2, 3),
             "os.truncate": (), "os.utime": (3,), "shutil.move": (), "shutil.copyfile": ()}
    procs = frozenset({"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                       "subprocess.Popen", "os.kill", "os.killpg", "pty.spawn"})
    def hook(event, args, isinstance=isinstance, any=any, str=str, bytes=bytes, int=int, bool=bool,
             len=len, PermissionError=PermissionError, Exception=Exception):
        def refuse(what):
            raise PermissionError("sandbox: " + what + " is refused")
        def inside(p):
            try:
                p = realpath(fsdecode(p))
            except Exception:
                return False
            return p == root or p.startswith(root + sep)
        if event == "open":
            path, mode, flags = args
            if isinstance(path, int) or path is None:
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & W)
            if writing and not inside(path):
                refuse("writing outside the sandbox directory (" + fsdecode(path) + ")")
        elif event.startswith("socket."):
            refuse("network access")
        elif event in paths:
            for i in paths[event]:
                if i < len(args) and args[i] is not None and args[i] != -100:
                    refuse(event + " relative to a directory descriptor")
            for a in args[:2]:
                if isinstance(a, (str, bytes, PathLike)) and not inside(a):
                    refuse(event + " outside the sandbox directory")
        elif event in procs:
            refuse("starting processes")
        elif event.startswith("ctypes."):
            refuse("ctypes")
    sys.addaudithook(hook)
_baton_guard()
del _baton_guard
"#;

fn isolation() -> Isolation {
    static FOUND: OnceLock<Isolation> = OnceLock::new();
    *FOUND.get_or_init(|| {
        let works = |program: &str, args: &[&str]| {
            std::process::Command::new(program)
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        // The very mounts and namespaces a run uses: a container that refuses one of them
        // (mounting /proc, say) must not pass this and then fail every program.
        let bwrap = [
            "--ro-bind",
            "/",
            "/",
            "--dev",
            "/dev",
            "--proc",
            "/proc",
            "--tmpfs",
            "/tmp",
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "true",
        ];
        if works("bwrap", &bwrap) {
            Isolation::Bubblewrap
        } else if works("unshare", &["--user", "--map-root-user", "--net", "true"]) {
            Isolation::NetworkNamespace
        } else {
            Isolation::GuardOnly
        }
    })
}

/// Runs code items' programs.
#[derive(Debug, Clone)]
pub struct Sandbox {
    python: PathBuf,
    /// The interpreter's installation (`sys.base_prefix`).
    prefix: PathBuf,
    pub limits: Limits,
    pub isolation: Isolation,
}

impl Sandbox {
    /// Finds python3 and the isolation this machine allows. Call before any paid call, so a
    /// machine without Python fails an evaluation of code items at once.
    pub fn new(limits: Limits) -> Result<Sandbox, SandboxError> {
        let shim = find_on_path("python3").ok_or_else(|| SandboxError::NoPython("python3 not found".into()))?;
        // The interpreter itself (not a launcher such as pyenv's shim) and where its library
        // lives: both must stay visible inside the sandbox. Audit hooks need Python 3.8.
        let probe = std::process::Command::new(&shim)
            .args([
                "-I",
                "-c",
                "import sys; assert sys.version_info >= (3, 8); print(sys.executable); print(sys.base_prefix)",
            ])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| SandboxError::NoPython(e.to_string()))?;
        let text = String::from_utf8_lossy(&probe.stdout);
        let mut lines = text.lines();
        let (Some(exe), Some(prefix), true) = (lines.next(), lines.next(), probe.status.success()) else {
            return Err(SandboxError::NoPython(format!("{} is not Python 3.8 or newer", shim.display())));
        };
        Ok(Sandbox { python: PathBuf::from(exe), prefix: PathBuf::from(prefix), limits, isolation: isolation() })
    }

    /// The program a code item's answer is checked with: the whole prompt (its imports and any
    /// helper functions the tests use; a candidate that writes the whole function replaces the
    /// prompt's stub, one that writes only the body completes it), the candidate, the tests,
    /// `check(entry_point)`, and then a mark that the tests ran to their end, so a program
    /// that exits early with status 0 does not pass.
    pub fn program(prompt: &str, candidate: &str, tests: &str, entry_point: &str) -> String {
        format!("{prompt}\n{candidate}\n\n{tests}\n\ncheck({entry_point})\nopen({CHECKED:?}, \"w\").write(\"ok\")\n")
    }

    /// Runs `program` under the guard, the limits and the isolation.
    pub async fn run(&self, program: &str) -> Result<Outcome, SandboxError> {
        let dir = tempfile::Builder::new().prefix("baton-sandbox-").tempdir()?;
        let root = dir.path().canonicalize()?;
        std::fs::write(root.join("main.py"), format!("{GUARD}\n{program}"))?;
        let python = self.python.to_string_lossy().into_owned();
        let root_s = root.to_string_lossy().into_owned();
        let mut command = match self.isolation {
            Isolation::Bubblewrap => {
                let mut c = tokio::process::Command::new("bwrap");
                c.args(["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]);
                if let Some(home) = std::env::var_os("HOME").filter(|h| Path::new(h).is_dir() && h != "/") {
                    c.arg("--tmpfs").arg(&home);
                    // An interpreter installed in the home directory (pyenv, conda) stays visible.
                    if self.prefix.starts_with(&home) {
                        c.arg("--ro-bind").arg(&self.prefix).arg(&self.prefix);
                    }
                }
                c.args(["--bind", &root_s, &root_s, "--chdir", &root_s]);
                c.args(["--unshare-all", "--die-with-parent", "--new-session", "--"]);
                c.args([python.as_str(), "-I", "-B", "main.py"]);
                c
            }
            Isolation::NetworkNamespace => {
                let mut c = tokio::process::Command::new("unshare");
                c.args(["--user", "--map-root-user", "--net", "--", python.as_str(), "-I", "-B", "main.py"]);
                c
            }
            Isolation::GuardOnly => {
                let mut c = tokio::process::Command::new(&self.python);
                c.args(["-I", "-B", "main.py"]);
                c
            }
        };
        command
            .current_dir(&root)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("HOME", &root)
            .env("LANG", "C.UTF-8")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let limits = self.limits;
        // SAFETY: between fork and exec only async-signal-safe calls (setsid, setrlimit).
        #[allow(unsafe_code)]
        unsafe {
            command.pre_exec(move || {
                libc::setsid();
                let set = |resource, value: u64| {
                    let limit = libc::rlimit { rlim_cur: value as libc::rlim_t, rlim_max: value as libc::rlim_t };
                    libc::setrlimit(resource, &limit);
                };
                set(libc::RLIMIT_CPU, limits.cpu_secs);
                set(libc::RLIMIT_AS, limits.memory_bytes);
                set(libc::RLIMIT_FSIZE, limits.file_bytes);
                set(libc::RLIMIT_CORE, 0);
                Ok(())
            });
        }
        let started = Instant::now();
        let mut child = command.spawn()?;
        let pid = child.id();
        let mut stderr = child.stderr.take();
        let read_err = async move {
            let mut buf = Vec::new();
            if let Some(s) = stderr.as_mut() {
                // Only the tail matters (the exception); bound what is kept.
                let _ = s.take(256 * 1024).read_to_end(&mut buf).await;
            }
            buf
        };
        let waited = tokio::time::timeout(limits.wall, async { tokio::join!(child.wait(), read_err) }).await;
        let wall_ms = started.elapsed().as_millis() as u64;
        let (status, err) = match waited {
            Ok((status, err)) => (status?, err),
            Err(_) => {
                if let Some(pid) = pid {
                    // SAFETY: signalling the process group this child leads (setsid above).
                    #[allow(unsafe_code)]
                    unsafe {
                        libc::kill(-(pid as i32), libc::SIGKILL)
                    };
                }
                let _ = child.kill().await;
                let reason = format!("stopped: over the {} s time limit", limits.wall.as_secs());
                return Ok(Outcome { passed: false, reason: Some(reason), wall_ms });
            }
        };
        if status.success() {
            if root.join(CHECKED).exists() {
                return Ok(Outcome { passed: true, reason: None, wall_ms });
            }
            let reason = "the program exited before its tests ran to their end".to_owned();
            return Ok(Outcome { passed: false, reason: Some(reason), wall_ms });
        }
        let text = String::from_utf8_lossy(&err);
        let last = text.lines().rev().map(str::trim).find(|l| !l.is_empty()).unwrap_or_default();
        use std::os::unix::process::ExitStatusExt;
        // bubblewrap reports a child killed by a signal as exit status 128 + signal.
        let signal = status.signal().or_else(|| status.code().filter(|c| *c > 128 && *c < 160).map(|c| c - 128));
        let reason = match signal {
            Some(libc::SIGXCPU) | Some(libc::SIGKILL) if last.is_empty() => {
                format!("stopped: over the {} s CPU limit", limits.cpu_secs)
            }
            Some(s) if last.is_empty() => format!("killed by signal {s}"),
            _ if last.is_empty() => format!("exited with {status}"),
            _ => last.chars().take(300).collect(),
        };
        Ok(Outcome { passed: false, reason: Some(reason), wall_ms })
    }
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths).map(|p| p.join(name)).find(|p| p.is_file()).and_then(|p| p.canonicalize().ok())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox() -> Sandbox {
        Sandbox::new(Limits { cpu_secs: 2, wall: Duration::from_secs(5), memory_bytes: 256 << 20, file_bytes: 1 << 20 })
            .expect("python3")
    }

    const TESTS: &str = "def check(candidate):\n    assert candidate(2, 3) == 5\n";

    #[tokio::test]
    async fn a_right_answer_passes_and_a_wrong_one_fails_with_the_assertion() {
        let s = sandbox();
        let prompt = "def add(a, b):\n    \"\"\"Add.\"\"\"\n";
        let good = s.run(&Sandbox::program(prompt, "    return a + b\n", TESTS, "add")).await.unwrap();
        assert!(good.passed, "{good:?}");
        let full = s.run(&Sandbox::program(prompt, "def add(a, b):\n    return b + a\n", TESTS, "add")).await.unwrap();
        assert!(full.passed, "{full:?}");
        let bad = s.run(&Sandbox::program(prompt, "    return a - b\n", TESTS, "add")).await.unwrap();
        assert!(!bad.passed);
        assert!(bad.reason.unwrap().contains("AssertionError"));
    }

    /// Each abuse ends in a failed item with a reason; none crashes or escapes.
    #[tokio::test]
    async fn loops_allocation_sockets_writes_and_processes_are_stopped_or_refused() {
        // With the OS isolation this machine has, and with the Python guard alone (a machine
        // without bubblewrap or user namespaces).
        let strongest = sandbox();
        let guard_only = Sandbox { isolation: Isolation::GuardOnly, ..strongest.clone() };
        for s in [strongest, guard_only] {
            abuse(&s).await;
        }
    }

    async fn abuse(s: &Sandbox) {
        let outside = tempfile::tempdir().unwrap();
        let target = outside.path().join("escaped.txt");
        let cases = [
            ("while True:\n    pass\n", "limit"),
            ("x = []\nwhile True:\n    x.append(' ' * (1 << 24))\n", "MemoryError"),
            ("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 9))\n", "network access"),
            (&format!("open({:?}, 'w').write('x')\n", target.to_string_lossy()), "sandbox"),
            ("import os\nos.system('true')\n", "starting processes"),
            ("import subprocess\nsubprocess.run(['true'])\n", "starting processes"),
            ("import ctypes\n", "ctypes"),
            ("import sys\nsys.exit(0)\n", "exited before its tests"),
            (
                &format!(
                    "isinstance = lambda *a: True\nany = lambda *a: False\nopen({:?}, 'w').write('x')\n",
                    target.to_string_lossy()
                ),
                "sandbox",
            ),
            (
                &format!(
                    "import os\nd = os.open('/', os.O_RDONLY)\nos.remove({:?}, dir_fd=d)\n",
                    target.to_string_lossy()
                ),
                "sandbox",
            ),
        ];
        for (code, want) in cases {
            let started = Instant::now();
            let out = s.run(code).await.unwrap();
            assert!(!out.passed, "{code}");
            let reason = out.reason.unwrap_or_default();
            assert!(reason.contains(want), "{:?} {code}: {reason}", s.isolation);
            assert!(started.elapsed() < Duration::from_secs(8), "{code}");
        }
        assert!(!target.exists(), "a write escaped the sandbox");
        // Writing inside its own directory is allowed.
        let inside =
            s.run(&format!("open('scratch.txt', 'w').write('ok')\nassert open('scratch.txt').read() == 'ok'\nopen({CHECKED:?}, 'w').write('ok')\n")).await.unwrap();
        assert!(inside.passed, "{inside:?}");
    }
}
