//! Where `ask` and `plan` write, read their standard input from, and learn that the user
//! interrupted them: this process's own streams and Ctrl-C, or, when the warm helper runs the
//! command (see `warm.rs`), the client that asked it over its socket.
//!
//! The commands write only through an [`Io`], so that one code path serves both: what a user
//! sees does not depend on whether the helper ran their question.

use std::io::{IsTerminal, Read, Write};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stream {
    Out,
    Err,
}

type Sink = dyn Fn(Stream, &str) + Send + Sync;

/// A command's standard streams and its interruption.
#[derive(Clone)]
pub struct Io {
    write: Arc<Sink>,
    /// The client's standard input, read by the client when the command reads it (`-`).
    stdin: Option<Arc<str>>,
    /// Whether progress on the error stream may be coloured (a terminal, and no `NO_COLOR`).
    pub color: bool,
    /// Cancelled when the user interrupts: by Ctrl-C here once [`Io::watch_ctrl_c`] is called,
    /// or by the client of the helper.
    pub cancel: CancellationToken,
    /// The client's own Ctrl-C cancels `cancel`, so this process must not listen for one.
    remote: bool,
}

impl std::fmt::Debug for Io {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Io").field("color", &self.color).field("remote", &self.remote).finish_non_exhaustive()
    }
}

impl Io {
    /// This process's stdout, stderr and stdin.
    pub fn terminal() -> Io {
        Io {
            write: Arc::new(|stream, text| {
                // A closed stream (`| head`) must not abort the command.
                let _ = match stream {
                    Stream::Out => {
                        std::io::stdout().lock().write_all(text.as_bytes()).and_then(|()| std::io::stdout().flush())
                    }
                    Stream::Err => std::io::stderr().lock().write_all(text.as_bytes()),
                };
            }),
            stdin: None,
            color: colored_stderr(),
            cancel: CancellationToken::new(),
            remote: false,
        }
    }

    /// Streams that go to `write`, for a client that sent its standard input along (if the
    /// command reads it) and cancels through `cancel`.
    pub fn remote(
        write: impl Fn(Stream, &str) + Send + Sync + 'static,
        stdin: Option<String>,
        color: bool,
        cancel: CancellationToken,
    ) -> Io {
        Io { write: Arc::new(write), stdin: stdin.map(Arc::from), color, cancel, remote: true }
    }

    pub fn out(&self, text: &str) {
        (self.write)(Stream::Out, text);
    }

    pub fn err(&self, text: &str) {
        (self.write)(Stream::Err, text);
    }

    /// The whole standard input.
    pub fn read_stdin(&self) -> std::io::Result<String> {
        match &self.stdin {
            Some(text) => Ok(text.to_string()),
            None if self.remote => Ok(String::new()),
            None => {
                let mut text = String::new();
                std::io::stdin().read_to_string(&mut text)?;
                Ok(text)
            }
        }
    }

    /// Until the returned task is aborted, Ctrl-C cancels [`Io::cancel`] instead of ending the
    /// process (for a command that must record that it stopped). Nothing to do in the helper,
    /// whose client says when the user interrupts.
    pub fn watch_ctrl_c(&self) -> Option<tokio::task::JoinHandle<()>> {
        (!self.remote).then(|| crate::cancel_on_ctrl_c(&self.cancel))
    }
}

/// Whether this process's stderr shows colour.
pub fn colored_stderr() -> bool {
    std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none()
}

/// `println!` to an [`Io`]'s standard output.
macro_rules! outln {
    ($io:expr) => { $io.out("\n") };
    ($io:expr, $($arg:tt)*) => { $io.out(&format!("{}\n", format_args!($($arg)*))) };
}

/// `eprintln!` to an [`Io`]'s error stream.
macro_rules! errln {
    ($io:expr, $($arg:tt)*) => { $io.err(&format!("{}\n", format_args!($($arg)*))) };
}

pub(crate) use {errln, outln};
