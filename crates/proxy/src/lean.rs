//! Requests without a body, decided before hyper reads them.
//!
//! A parked request served by hyper holds an HTTP/1 connection's state: an 8 KiB read
//! buffer, an 8 KiB write buffer and hyper's dispatcher, which is most of its memory
//! (docs/BENCHMARKS.md, "Where the bytes of a parked request go"). So the first request
//! of a plaintext HTTP/1.1 connection, and each one after a verdict answered here, is
//! peeked at and, when it has no body and nothing hyper must handle ([`parse`]),
//! decided here:
//!
//! - decided at once (a route under a lease, a denial): nothing is taken off the
//!   socket; a route hands the connection to hyper with its decision, which reads the
//!   request as usual;
//! - it waits (it parks): its head is read off the socket, so the wait holds the head
//!   and the decision's own state only, and a client that leaves is seen (the socket
//!   reads end of file). A route hands hyper the connection with the head put back in
//!   front ([`Replayed`]); a verdict is written here ([`response`]), and the connection
//!   waits for its next request.
//!
//! Every other request (a body, an upgrade, `Expect`, HTTP/1.0, a head over
//! [`PEEK`] bytes or sent in pieces, anything malformed) goes to hyper untouched.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf as _, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use valet_router::Verdict;

use crate::limits::Limits;

/// Most bytes of a request head decided here (peeked at in one read).
pub(crate) const PEEK: usize = 2048;

/// Most header fields of a request decided here.
const FIELDS: usize = 32;

/// What a request decided here needs of its head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Head {
    /// Bytes of the head on the socket, the blank line included.
    pub(crate) len: usize,
    /// The `Host` header's value (the first one; empty when absent or not visible
    /// ASCII), as the data plane reads it for every request.
    pub(crate) host: String,
    /// The request target (origin form).
    pub(crate) path: String,
    /// A `HEAD` request: its answer has no body.
    pub(crate) head_only: bool,
    /// The client asked to close the connection after this request.
    pub(crate) close: bool,
}

/// The head at the start of `buf`, when it is a request decided here: complete,
/// HTTP/1.1, origin form, no body (`Content-Length` absent or `0`, no
/// `Transfer-Encoding`), no `Upgrade` or `Expect`, within `limits`. `None` hands the
/// request to hyper, which answers whatever is wrong with it.
pub(crate) fn parse(buf: &[u8], limits: Limits) -> Option<Head> {
    let mut fields = [httparse::EMPTY_HEADER; FIELDS];
    let mut req = httparse::Request::new(&mut fields);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) | Err(_) => return None,
    };
    if req.version != Some(1) {
        return None;
    }
    let method = req.method?;
    let target = req.path?;
    if method == "CONNECT" || !target.starts_with('/') {
        return None;
    }
    // hyper would refuse what `http` cannot parse (400): leave that to it.
    target.parse::<http::uri::PathAndQuery>().ok()?;
    let mut host = None;
    let mut close = false;
    let mut bytes = 0;
    for field in req.headers.iter() {
        bytes += field.name.len() + field.value.len();
        let is = |name: &str| field.name.eq_ignore_ascii_case(name);
        if is("host") {
            // Two are refused by the full path (`server::handle`).
            if host.is_some() {
                return None;
            }
            host = Some(visible_ascii(field.value).unwrap_or_default());
        } else if is("content-length") {
            if field.value != b"0" {
                return None;
            }
        } else if is("transfer-encoding") || is("upgrade") || is("expect") {
            return None;
        } else if is("connection") {
            close |= field
                .value
                .split(|&b| b == b',')
                .any(|token| token.trim_ascii().eq_ignore_ascii_case(b"close"));
        }
    }
    if req.headers.len() > limits.max_headers || bytes > limits.max_header_bytes {
        return None;
    }
    Some(Head {
        len,
        host: host.unwrap_or_default().to_owned(),
        path: target.to_owned(),
        head_only: method == "HEAD",
        close,
    })
}

/// `value` as a string when it is visible ASCII (what `HeaderValue::to_str` accepts).
fn visible_ascii(value: &[u8]) -> Option<&str> {
    value
        .iter()
        .all(|&b| b == b'\t' || (0x20..0x7f).contains(&b))
        .then(|| std::str::from_utf8(value).ok())
        .flatten()
}

/// The verdict `v` as HTTP/1.1 bytes, with the headers hyper would write for it.
pub(crate) fn response(v: &Verdict, head_only: bool, close: bool) -> Vec<u8> {
    use std::io::Write as _;
    let status = v.status();
    let body = v.body().as_bytes();
    let mut out = Vec::with_capacity(192 + body.len());
    let _ = write!(
        out,
        "HTTP/1.1 {} {}\r\ncontent-type: {}\r\n",
        status.as_str(),
        status.canonical_reason().unwrap_or(""),
        v.content_type()
    );
    if let Some(secs) = v.retry_after_secs() {
        let _ = write!(out, "retry-after: {secs}\r\n");
    }
    if close {
        out.extend_from_slice(b"connection: close\r\n");
    }
    let _ = write!(
        out,
        "content-length: {}\r\ndate: {}\r\n\r\n",
        body.len(),
        httpdate::fmt_http_date(std::time::SystemTime::now())
    );
    if !head_only {
        out.extend_from_slice(body);
    }
    out
}

/// Resolves when the client has gone: the socket reads end of file or fails. Bytes
/// that arrive meanwhile (a pipelined request) are read into `extra`, up to [`PEEK`],
/// so the client stays watched; past that it is not watched any more (the wait still
/// ends with its decision). Cancel-safe: every byte read is in `extra`.
pub(crate) async fn gone(stream: &TcpStream, extra: &mut Vec<u8>) {
    loop {
        if extra.len() >= PEEK {
            return std::future::pending().await;
        }
        if stream.readable().await.is_err() {
            return;
        }
        // Read on the stack: the readiness may be stale (nothing arrived), and a wait
        // that is sent nothing holds no buffer.
        let mut chunk = [0u8; 512];
        let room = chunk.len().min(PEEK - extra.len());
        match stream.try_read(&mut chunk[..room]) {
            Ok(0) => return,
            Ok(n) => extra.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return,
        }
    }
}

/// Reads and drops what the client has sent and is readable now (up to 64 KiB), so
/// that closing the socket sends a FIN rather than a reset.
pub(crate) fn discard_readable(stream: &TcpStream) {
    let mut chunk = [0u8; 4096];
    for _ in 0..16 {
        match stream.try_read(&mut chunk) {
            Ok(n) if n > 0 => {}
            _ => return,
        }
    }
}

/// A plaintext connection's socket, with the bytes of a request head already read off
/// it put back in front for hyper.
#[derive(Debug)]
pub(crate) struct Replayed {
    head: Bytes,
    stream: TcpStream,
}

impl Replayed {
    pub(crate) fn new(stream: TcpStream, head: Bytes) -> Self {
        Self { head, stream }
    }
}

impl AsyncRead for Replayed {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.head.is_empty() {
            return Pin::new(&mut this.stream).poll_read(cx, buf);
        }
        let n = this.head.len().min(buf.remaining());
        buf.put_slice(&this.head[..n]);
        this.head.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Replayed {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use valet_router::Denial;

    fn limits() -> Limits {
        Limits::default()
    }

    #[test]
    fn a_get_without_a_body_is_decided_here() {
        let raw = b"GET /a?b=1 HTTP/1.1\r\nHost: p1.actors.local\r\nAccept: */*\r\n\r\nGET /next";
        let head = parse(raw, limits()).expect("eligible");
        assert_eq!(
            head,
            Head {
                len: raw.len() - b"GET /next".len(),
                host: "p1.actors.local".into(),
                path: "/a?b=1".into(),
                head_only: false,
                close: false,
            }
        );
    }

    #[test]
    fn connection_close_head_and_an_empty_length_are_kept() {
        let raw =
            b"HEAD / HTTP/1.1\r\nhost: a\r\nContent-Length: 0\r\nConnection: keep-alive, Close\r\n\r\n";
        let head = parse(raw, limits()).expect("eligible");
        assert!(head.head_only && head.close);
        assert_eq!(head.host, "a");
    }

    #[test]
    fn two_hosts_go_to_hyper_and_one_not_visible_ascii_is_empty() {
        // The full path answers them: invalid host.
        let two = b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n";
        assert!(parse(two, limits()).is_none());
        let odd = b"GET / HTTP/1.1\r\nHost: \xc3\xa9\r\n\r\n";
        assert_eq!(parse(odd, limits()).unwrap().host, "");
        let none = b"GET / HTTP/1.1\r\n\r\n";
        assert_eq!(parse(none, limits()).unwrap().host, "");
    }

    #[test]
    fn everything_hyper_must_handle_goes_to_hyper() {
        for raw in [
            &b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc"[..],
            b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\n\r\n",
            b"GET / HTTP/1.0\r\nHost: a\r\n\r\n",
            b"GET http://a/ HTTP/1.1\r\nHost: a\r\n\r\n",
            b"CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n",
            b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
            b"GET / HTTP/1.1\r\nHost: a\r\n",
            b"GET / HTTP/1.1\r\nHo st: a\r\n\r\n",
        ] {
            assert_eq!(
                parse(raw, limits()),
                None,
                "{}",
                String::from_utf8_lossy(raw)
            );
        }
        let many: String = (0..FIELDS + 1).map(|i| format!("x-{i}: 1\r\n")).collect();
        let raw = format!("GET / HTTP/1.1\r\nHost: a\r\n{many}\r\n");
        assert_eq!(parse(raw.as_bytes(), limits()), None);
    }

    #[test]
    fn the_data_planes_limits_apply() {
        let raw = b"GET / HTTP/1.1\r\nHost: a\r\nX-A: 1\r\nX-B: 2\r\n\r\n";
        let tight = Limits {
            max_headers: 2,
            ..Limits::default()
        };
        assert_eq!(parse(raw, tight), None);
        let small = Limits {
            max_header_bytes: 10,
            ..Limits::default()
        };
        assert_eq!(parse(raw, small), None);
        assert!(parse(raw, limits()).is_some());
    }

    #[test]
    fn a_verdict_is_written_as_hyper_would() {
        let actor: valet_router::ActorRef = "default/p1".parse().unwrap();
        let verdicts = [
            Verdict::of(&Denial::ShuttingDown(actor.clone())),
            Verdict::of(&Denial::LotFull(actor)),
        ];
        for v in verdicts {
            let out = String::from_utf8(response(&v, false, true)).unwrap();
            let (head, body) = out.split_once("\r\n\r\n").unwrap();
            assert!(head.starts_with(&format!(
                "HTTP/1.1 {} {}\r\n",
                v.status().as_str(),
                v.status().canonical_reason().unwrap()
            )));
            // Every header the hyper path's rendering of the verdict has.
            for (name, value) in crate::answer::render(&v).headers() {
                let line = format!("\r\n{name}: {}\r\n", value.to_str().unwrap());
                assert!(out.contains(&line), "{line:?} missing from {head}");
            }
            assert!(head.contains("\r\nconnection: close\r\n"));
            assert!(head.contains(&format!("\r\ncontent-length: {}\r\n", v.body().len())));
            assert!(head.contains("\r\ndate: "));
            assert_eq!(body, v.body());
            let head_only = String::from_utf8(response(&v, true, false)).unwrap();
            assert!(head_only.ends_with("\r\n\r\n") && !head_only.contains("connection"));
        }
    }

    #[tokio::test]
    async fn the_head_put_back_is_read_first_then_the_socket() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server, _) = l.accept().await.unwrap();
        client.write_all(b" world").await.unwrap();
        drop(client);
        let mut io = Replayed::new(server, Bytes::from_static(b"hello"));
        let mut all = String::new();
        io.read_to_string(&mut all).await.unwrap();
        assert_eq!(all, "hello world");
    }

    #[tokio::test]
    async fn a_client_that_leaves_is_gone_even_after_sending_more() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server, _) = l.accept().await.unwrap();
        let mut extra = Vec::new();
        {
            let watch = gone(&server, &mut extra);
            tokio::pin!(watch);
            assert!(futures_poll_once(watch.as_mut()).await.is_pending());
            client.write_all(b"GET /next").await.unwrap();
            drop(client);
            watch.await;
        }
        assert_eq!(
            extra, b"GET /next",
            "the bytes sent before leaving are kept"
        );
    }

    /// The paused clock moves on only once the runtime is idle: the watch has read
    /// what it will and waits on nothing but the timeout.
    #[tokio::test(start_paused = true)]
    async fn past_the_bound_the_client_is_not_watched() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut client = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
        let (server, _) = l.accept().await.unwrap();
        client.write_all(&[b'x'; PEEK + 10]).await.unwrap();
        drop(client);
        // Every byte visible to the server first: the clock moves on once the runtime
        // is idle, whether or not loopback has delivered them.
        let mut seen = vec![0u8; PEEK + 10];
        while server.peek(&mut seen).await.unwrap() < PEEK + 10 {
            server.readable().await.unwrap();
        }
        let mut extra = Vec::new();
        let watch = gone(&server, &mut extra);
        assert!(
            tokio::time::timeout(std::time::Duration::from_secs(60), watch)
                .await
                .is_err(),
            "not watched past the bound"
        );
        assert!(extra.len() >= PEEK);
    }

    async fn futures_poll_once<F: std::future::Future + Unpin>(mut f: F) -> Poll<F::Output> {
        std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut f).poll(cx))).await
    }
}
