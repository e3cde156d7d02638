//! Connections whose client stops reading. A streamed answer is written as the run goes; a
//! client that stops reading (a hung process, a frozen tab) fills the socket's buffers, and
//! every write then waits. A write that makes no progress for the server's `write_stall`
//! fails the connection, which drops the response and so cancels its run, as a disconnect
//! does; the history keeps the run as cancelled.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Sleep;

/// A listener whose connections fail a write that waits longer than `stall`, and that holds
/// at most as many connections open as `connections` has permits: past them it accepts no
/// more until one closes (new ones wait in the system's backlog), so a flood of idle
/// connections cannot take memory without end.
#[derive(Debug)]
pub(crate) struct Stalling<L> {
    pub(crate) inner: L,
    pub(crate) stall: Duration,
    pub(crate) connections: std::sync::Arc<tokio::sync::Semaphore>,
}

impl<L: axum::serve::Listener> axum::serve::Listener for Stalling<L> {
    type Io = StallingIo<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        // The semaphore is never closed, so a permit always comes.
        let permit = self.connections.clone().acquire_owned().await.ok();
        let (io, addr) = self.inner.accept().await;
        let timer = Box::pin(tokio::time::sleep(self.stall));
        (StallingIo { inner: io, stall: self.stall, timer, armed: false, _open: permit }, addr)
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}

/// A connection that fails a write still waiting after `stall`.
#[derive(Debug)]
pub(crate) struct StallingIo<T> {
    inner: T,
    stall: Duration,
    /// One per connection, reset when a write starts to wait: armed while one waits.
    timer: Pin<Box<Sleep>>,
    armed: bool,
    /// The connection's place under the listener's bound, freed when it closes.
    _open: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl<T> StallingIo<T> {
    /// Passes on a write's progress; a write still waiting after the stall fails.
    fn watch<R>(&mut self, cx: &mut Context<'_>, polled: Poll<io::Result<R>>) -> Poll<io::Result<R>> {
        if polled.is_ready() {
            self.armed = false;
            return polled;
        }
        if !self.armed {
            let deadline = tokio::time::Instant::now() + self.stall;
            self.timer.as_mut().reset(deadline);
            self.armed = true;
        }
        ready!(self.timer.as_mut().poll(cx));
        Poll::Ready(Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the client read nothing for {} s", self.stall.as_secs_f64()),
        )))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StallingIo<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallingIo<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.watch(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.watch(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
