//! Network faults between real processes: a TCP proxy that can go silent.

use tokio::net::TcpListener;

/// A TCP proxy that forwards both ways until told to drop everything; from then on it
/// moves no byte and keeps every connection open, like a network that drops every
/// packet (no reset ever arrives).
pub async fn blackhole_proxy(
    upstream: std::net::SocketAddr,
) -> (String, tokio::sync::watch::Sender<bool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (drop_all, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        loop {
            let (down, _) = listener.accept().await.unwrap();
            let up = tokio::net::TcpStream::connect(upstream).await.unwrap();
            let (dr, dw) = down.into_split();
            let (ur, uw) = up.into_split();
            tokio::spawn(pipe(dr, uw, rx.clone()));
            tokio::spawn(pipe(ur, dw, rx.clone()));
        }
    });
    (url, drop_all)
}

/// A TCP proxy to `upstream` that counts the bytes its clients send. Its URL and the
/// count.
pub async fn counting_proxy(
    upstream: &str,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicU64>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let upstream: std::net::SocketAddr = upstream.trim_start_matches("http://").parse().unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let count = std::sync::Arc::clone(&sent);
    tokio::spawn(async move {
        loop {
            let (down, _) = listener.accept().await.unwrap();
            let up = tokio::net::TcpStream::connect(upstream).await.unwrap();
            let (mut dr, mut dw) = down.into_split();
            let (mut ur, mut uw) = up.into_split();
            let count = std::sync::Arc::clone(&count);
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 * 1024];
                while let Ok(n @ 1..) = dr.read(&mut buf).await {
                    count.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
                    if uw.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
            tokio::spawn(async move {
                let _ = tokio::io::copy(&mut ur, &mut dw).await;
            });
        }
    });
    (url, sent)
}

/// Copies `from` to `to` until `drop_all` turns true, then holds both open, silent.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut drop_all: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = tokio::select! {
            n = from.read(&mut buf) => n,
            _ = drop_all.wait_for(|dropping| *dropping) => break,
        };
        match n {
            Ok(0) | Err(_) => return,
            Ok(_) if *drop_all.borrow() => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
        }
    }
    std::future::pending::<()>().await;
    drop((from, to));
}

/// An HTTP/2 server that takes every call and never answers it (pings are answered:
/// the connection lives). Its URL.
pub async fn unanswering_server() -> String {
    h2_server(|| async {
        std::future::pending::<hyper::Response<http_body_util::Empty<bytes::Bytes>>>().await
    })
    .await
}

/// A gRPC server that answers every call `UNAVAILABLE` itself (as a replica whose
/// database write failed): a trailers-only answer. Its URL.
pub async fn unavailable_server() -> String {
    h2_server(|| async {
        hyper::Response::builder()
            .header("content-type", "application/grpc")
            .header("grpc-status", "14")
            .header("grpc-message", "the database write failed")
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap()
    })
    .await
}

/// An HTTP/2 (h2c) server on 127.0.0.1:0 answering every request with `answer()`.
async fn h2_server<F, Fut>(answer: F) -> String
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = hyper::Response<http_body_util::Empty<bytes::Bytes>>>
        + Send
        + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (io, _) = listener.accept().await.unwrap();
            let answer = answer.clone();
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(
                        hyper_util::rt::TokioIo::new(io),
                        hyper::service::service_fn(move |_req| {
                            let answer = answer.clone();
                            async move { Ok::<_, std::convert::Infallible>(answer().await) }
                        }),
                    ),
            );
        }
    });
    url
}
