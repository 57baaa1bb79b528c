//! The one listener of every valet server, and the connections it accepted.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::Backoff;

/// How many connections may be open at once: each accepted connection holds a
/// [`Place`] until it closes, and a listener whose budget is spent accepts nothing
/// (new connections wait in the kernel's listen backlog) until one does. Clones share
/// the places: listeners given one budget share it.
#[derive(Debug, Clone)]
pub struct Budget {
    places: Arc<Semaphore>,
    size: usize,
}

impl Budget {
    /// `size` places (at least one).
    pub fn new(size: usize) -> Self {
        let size = size.clamp(1, Semaphore::MAX_PERMITS);
        Self {
            places: Arc::new(Semaphore::new(size)),
            size,
        }
    }

    /// Half the process's open-file limit (`RLIMIT_NOFILE`), at least 64: the other
    /// half is left for the connections the process opens itself (to workers, to the
    /// control plane, to its database) and its files. Each listener without a budget of
    /// its own gets one of these: where one process runs several servers (`valet up`),
    /// their budgets together exceed the limit until they share one.
    pub fn half_the_file_limit() -> Self {
        let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
        Self::new(
            nofile
                .map_or(usize::MAX, |n| usize::try_from(n / 2).unwrap_or(usize::MAX))
                .max(64),
        )
    }

    /// How many places the budget has.
    pub fn size(&self) -> usize {
        self.size
    }

    /// How many places are taken now.
    pub fn in_use(&self) -> usize {
        self.size - self.places.available_permits()
    }

    /// A place now, if one is free.
    pub fn try_place(&self) -> Option<Place> {
        Arc::clone(&self.places).try_acquire_owned().ok().map(Place)
    }

    /// A place, once one is free.
    pub async fn place(&self) -> Place {
        Place(
            Arc::clone(&self.places)
                .acquire_owned()
                .await
                .expect("the budget's semaphore is never closed"),
        )
    }
}

/// A connection's place in its [`Budget`], given back when dropped.
#[derive(Debug)]
pub struct Place(#[allow(dead_code)] OwnedSemaphorePermit);

/// TCP keepalive for accepted connections: a peer gone without a word (its host lost,
/// a NAT entry dropped) is noticed after `idle + interval × retries`. Data sent and
/// left unacknowledged that long ends the connection too (`TCP_USER_TIMEOUT`), not the
/// kernel's ~15 minutes of retransmissions.
#[derive(Debug, Clone, Copy)]
pub struct Keepalive {
    pub idle: Duration,
    pub interval: Duration,
    pub retries: u32,
}

impl Keepalive {
    fn reach(&self) -> Duration {
        self.idle + self.interval * self.retries
    }
}

/// A TCP listener with everything a valet server wants of one (see the crate's
/// documentation). Accepted sockets get `TCP_NODELAY`, and the [`Keepalive`] when
/// given one.
#[derive(Debug)]
pub struct Listener {
    tcp: TcpListener,
    budget: Budget,
    keepalive: Option<Keepalive>,
    what: &'static str,
    /// The waits after failed accepts, kept across calls (an accept cancelled while
    /// it waits does not start them over), reset by a successful one.
    again: std::sync::Mutex<Backoff>,
    /// When a full budget was last said.
    said_full: std::sync::Mutex<Option<tokio::time::Instant>>,
}

/// How often a listener whose budget is spent says so, at most.
const SAY_FULL_EVERY: Duration = Duration::from_secs(10);

/// The first wait after a failed `accept`, and the longest.
const ACCEPT_AGAIN: Duration = Duration::from_millis(5);
const ACCEPT_AGAIN_MAX: Duration = Duration::from_secs(1);

impl Listener {
    /// Listens on `tcp`, within [`Budget::half_the_file_limit`]; `what` names the
    /// server in its log lines.
    pub fn new(tcp: TcpListener, what: &'static str) -> Self {
        Self {
            tcp,
            budget: Budget::half_the_file_limit(),
            keepalive: None,
            what,
            again: std::sync::Mutex::new(Backoff::new(ACCEPT_AGAIN).cap(ACCEPT_AGAIN_MAX)),
            said_full: std::sync::Mutex::new(None),
        }
    }

    /// Within `budget` instead.
    #[must_use]
    pub fn budget(mut self, budget: Budget) -> Self {
        self.budget = budget;
        self
    }

    /// With TCP keepalive on accepted connections.
    #[must_use]
    pub fn keepalive(mut self, keepalive: Keepalive) -> Self {
        self.keepalive = Some(keepalive);
        self
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }

    /// The next connection, once the budget has a place for it; `None` once `stop` is
    /// cancelled. A failed `accept` (out of descriptors, say) is logged and tried again
    /// after a wait (5 ms doubling to 1 s), never in a spin.
    pub async fn accept(&self, stop: &CancellationToken) -> Option<Accepted> {
        let place = match self.budget.try_place() {
            Some(place) => place,
            None => {
                self.say_full();
                tokio::select! {
                    () = stop.cancelled() => return None,
                    place = self.budget.place() => place,
                }
            }
        };
        loop {
            let accepted = tokio::select! {
                () = stop.cancelled() => return None,
                accepted = self.tcp.accept() => accepted,
            };
            match accepted {
                Ok((stream, peer)) => {
                    self.again
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .reset();
                    self.tune(&stream);
                    return Some(Accepted {
                        stream,
                        peer,
                        place,
                    });
                }
                Err(e) => {
                    let wait = self
                        .again
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .next_delay();
                    tracing::warn!(error = %e, what = self.what, retry_in = ?wait, "cannot accept a connection");
                    tokio::select! {
                        () = stop.cancelled() => return None,
                        () = tokio::time::sleep(wait) => {}
                    }
                }
            }
        }
    }

    /// Says (at most every [`SAY_FULL_EVERY`]) that new connections wait for a place.
    fn say_full(&self) {
        let now = tokio::time::Instant::now();
        let mut said = self
            .said_full
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if said.is_none_or(|at| now.duration_since(at) >= SAY_FULL_EVERY) {
            *said = Some(now);
            tracing::warn!(
                what = self.what,
                budget = self.budget.size(),
                "connection budget spent: new connections wait in the listen backlog until one closes"
            );
        }
    }

    /// The accepted connections as a stream (for tonic's `serve_with_incoming`); it
    /// ends once `stop` is cancelled, and the listener (its port) with it.
    pub fn incoming(
        self,
        stop: CancellationToken,
    ) -> impl futures_util::Stream<Item = std::io::Result<Accepted>> + Send + 'static {
        futures_util::stream::unfold((self, stop), |(listener, stop)| async move {
            let accepted = listener.accept(&stop).await?;
            Some((Ok(accepted), (listener, stop)))
        })
    }

    fn tune(&self, stream: &TcpStream) {
        if let Err(e) = stream.set_nodelay(true) {
            tracing::debug!(error = %e, what = self.what, "cannot set TCP_NODELAY");
        }
        let Some(k) = self.keepalive else { return };
        let sock = socket2::SockRef::from(stream);
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(k.idle)
            .with_interval(k.interval)
            .with_retries(k.retries);
        if let Err(e) = sock.set_tcp_keepalive(&keepalive) {
            tracing::debug!(error = %e, what = self.what, "cannot set TCP keepalive");
        }
        if let Err(e) = sock.set_tcp_user_timeout(Some(k.reach())) {
            tracing::debug!(error = %e, what = self.what, "cannot set TCP_USER_TIMEOUT");
        }
    }
}

/// An accepted connection, holding its place in the listener's budget until dropped.
#[derive(Debug)]
pub struct Accepted {
    stream: TcpStream,
    peer: SocketAddr,
    place: Place,
}

impl Accepted {
    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// The socket, its peer and its place (keep the place as long as the socket).
    pub fn into_parts(self) -> (TcpStream, SocketAddr, Place) {
        (self.stream, self.peer, self.place)
    }
}

impl AsyncRead for Accepted {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Accepted {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Accepted {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.stream.connect_info()
    }
}

/// The tasks of the connections a server accepted: every one is owned here, so a
/// shutdown can wait for them.
#[derive(Debug, Clone, Default)]
pub struct Connections {
    tracker: TaskTracker,
    force: CancellationToken,
}

impl Connections {
    pub fn new() -> Self {
        Self::default()
    }

    /// Serves a connection on a task of its own, ended (dropped) at once when
    /// [`Connections::force`] is cancelled: a forced drain always ends.
    pub fn spawn<F>(&self, serving: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let force = self.force.clone();
        self.tracker.spawn(async move {
            tokio::select! {
                () = serving => {}
                () = force.cancelled() => {}
            }
        });
    }

    /// Cancelled when a drain's grace has ended: a connection still open closes at
    /// once when it is.
    pub fn force(&self) -> CancellationToken {
        self.force.clone()
    }

    /// Closes every connection still open, at once (cancels [`Connections::force`]).
    pub fn force_now(&self) {
        self.force.cancel();
    }

    /// How many connections are being served.
    pub fn len(&self) -> usize {
        self.tracker.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tracker.is_empty()
    }

    /// Takes no more connections, and waits for every one to end.
    pub async fn wait(&self) {
        self.tracker.close();
        self.tracker.wait().await;
    }

    /// Takes no more connections, waits up to `grace` for every one to end, then
    /// cancels [`Connections::force`] and waits for the rest. Whether all ended within
    /// the grace.
    pub async fn drain(&self, grace: Duration) -> bool {
        if tokio::time::timeout(grace, self.wait()).await.is_ok() {
            return true;
        }
        self.force.cancel();
        self.tracker.wait().await;
        false
    }
}

/// A connection whose first `want` bytes must arrive within a deadline: hyper's
/// HTTP/2 server waits for the client's preface without one (its keep-alive pings
/// start after it), so a client that connects and sends nothing would hold its
/// connection for good. A read past the deadline fails, which ends the connection.
#[derive(Debug)]
pub struct FirstBytes<S> {
    io: S,
    /// First bytes still to come.
    want: usize,
    /// Until they have come.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    within: Duration,
}

impl<S> FirstBytes<S> {
    /// `io`, whose first `want` bytes must come `within` from now.
    pub fn new(io: S, want: usize, within: Duration) -> Self {
        Self {
            io,
            want,
            deadline: Some(Box::pin(tokio::time::sleep(within))),
            within,
        }
    }

    /// The HTTP/2 client connection preface (RFC 9113, section 3.4: 24 bytes) within
    /// `within`.
    pub fn h2_preface(io: S, within: Duration) -> Self {
        Self::new(io, 24, within)
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for FirstBytes<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                this.want = this.want.saturating_sub(buf.filled().len() - before);
                if this.want == 0 {
                    this.deadline = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                let late = this
                    .deadline
                    .as_mut()
                    .is_some_and(|deadline| deadline.as_mut().poll(cx).is_ready());
                if late {
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!(
                            "no first bytes (an HTTP/2 preface) within {:?}",
                            this.within
                        ),
                    )));
                }
                Poll::Pending
            }
            failed => failed,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FirstBytes<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected for FirstBytes<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn bound() -> Listener {
        Listener::new(TcpListener::bind("127.0.0.1:0").await.unwrap(), "test")
    }

    #[tokio::test]
    async fn a_spent_budget_accepts_nothing_until_a_connection_closes() {
        let budget = Budget::new(1);
        let listener = bound().await.budget(budget.clone());
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let _a = TcpStream::connect(addr).await.unwrap();
        let first = listener.accept(&stop).await.unwrap();
        assert_eq!(budget.in_use(), 1);
        let _b = TcpStream::connect(addr).await.unwrap();
        // The second waits (in the backlog) while the first holds the only place...
        let mut second = Box::pin(listener.accept(&stop));
        assert!(
            futures_util::poll!(second.as_mut()).is_pending(),
            "no place: nothing accepted"
        );
        // ...and is accepted once the first is closed.
        drop(first);
        let second = second.await.unwrap();
        assert_eq!(budget.in_use(), 1);
        drop(second);
        assert_eq!(budget.in_use(), 0);
    }

    #[tokio::test]
    async fn a_budget_is_shared_by_the_listeners_given_it() {
        let budget = Budget::new(1);
        let (one, two) = (
            bound().await.budget(budget.clone()),
            bound().await.budget(budget.clone()),
        );
        let stop = CancellationToken::new();
        let _a = TcpStream::connect(one.local_addr().unwrap()).await.unwrap();
        let _b = TcpStream::connect(two.local_addr().unwrap()).await.unwrap();
        let held = one.accept(&stop).await.unwrap();
        let mut other = Box::pin(two.accept(&stop));
        assert!(futures_util::poll!(other.as_mut()).is_pending());
        drop(held);
        assert!(other.await.is_some());
    }

    #[tokio::test]
    async fn a_stop_ends_the_wait_for_a_connection_or_a_place() {
        let listener = bound().await.budget(Budget::new(1));
        let stop = CancellationToken::new();
        let _a = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let _held = listener.accept(&stop).await.unwrap();
        stop.cancel();
        assert!(
            listener.accept(&stop).await.is_none(),
            "waiting for a place"
        );
        let listener = bound().await;
        assert!(
            listener.accept(&stop).await.is_none(),
            "waiting for a connection"
        );
    }

    #[tokio::test]
    async fn accepted_sockets_are_tuned_and_carry_bytes() {
        let listener = bound().await.keepalive(Keepalive {
            idle: Duration::from_secs(60),
            interval: Duration::from_secs(10),
            retries: 3,
        });
        let stop = CancellationToken::new();
        let mut client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let mut conn = listener.accept(&stop).await.unwrap();
        assert_eq!(conn.peer(), client.local_addr().unwrap());
        client.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        conn.read_exact(&mut buf).await.unwrap();
        conn.write_all(b"pong").await.unwrap();
        client.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"pong");
        let (stream, _, _place) = conn.into_parts();
        assert!(stream.nodelay().unwrap());
        let sock = socket2::SockRef::from(&stream);
        assert!(sock.keepalive().unwrap());
        assert_eq!(
            sock.tcp_user_timeout().unwrap(),
            Some(Duration::from_secs(90))
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_drain_waits_its_grace_then_forces() {
        let connections = Connections::new();
        // One that ends by itself within the grace, one that ends only when forced.
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
        connections.spawn(async move {
            let _ = done_rx.await;
        });
        // One that ignores the force: ended by it all the same.
        connections.spawn(std::future::pending());
        assert_eq!(connections.len(), 2);
        let start = tokio::time::Instant::now();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let _ = done_tx.send(());
        });
        assert!(!connections.drain(Duration::from_secs(5)).await);
        assert_eq!(start.elapsed(), Duration::from_secs(5));
        assert!(connections.is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_without_its_first_bytes_fails_at_the_deadline() {
        let (client, server) = tokio::io::duplex(64);
        let mut conn = FirstBytes::h2_preface(server, Duration::from_secs(10));
        let mut buf = [0u8; 8];
        let err = conn.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        drop(client);
        // With its bytes in time, no deadline is left.
        let (mut client, server) = tokio::io::duplex(64);
        let mut conn = FirstBytes::new(server, 4, Duration::from_secs(10));
        client.write_all(b"abcd").await.unwrap();
        let mut buf = [0u8; 4];
        conn.read_exact(&mut buf).await.unwrap();
        let late = tokio::spawn(async move {
            let mut buf = [0u8; 4];
            conn.read_exact(&mut buf).await.map(|_| buf)
        });
        tokio::time::sleep(Duration::from_secs(60)).await;
        client.write_all(b"efgh").await.unwrap();
        assert_eq!(&late.await.unwrap().unwrap(), b"efgh");
    }
}
