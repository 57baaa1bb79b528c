//! Every server valet runs sets `TCP_NODELAY` on the connections it accepts, so small
//! answers (gRPC replies, verdicts) never wait for the peer's delayed ACK. Checked on
//! the real process's own accepted sockets.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::socket::{accepted_keepalive, accepted_nodelay};
use common::{Up, eventually};

async fn check(pid: u32, part: &str, server: SocketAddr) {
    let client = tokio::net::TcpStream::connect(server).await.unwrap();
    let local = client.local_addr().unwrap();
    let nodelay = eventually(
        &format!("{part} accepted the connection"),
        Duration::from_secs(10),
        || async move { accepted_nodelay(pid, server, local) },
    )
    .await;
    assert!(
        nodelay,
        "{part} ({server}) accepted a socket without TCP_NODELAY"
    );
    drop(client);
}

#[tokio::test]
async fn every_server_sets_nodelay_on_accepted_sockets() {
    let up = Up::start(&["--workers", "1"]).await;
    let pid = up.child.id().unwrap();
    let workers = up
        .client()
        .list_workers(())
        .await
        .unwrap()
        .into_inner()
        .workers;
    let worker: SocketAddr = workers[0].ip.parse().unwrap();
    for (part, addr) in [
        ("router", up.router),
        ("extproc", up.extproc.unwrap()),
        ("admin", up.admin),
        ("control-plane", up.control_plane),
        ("control-plane metrics", up.metrics),
        ("worker", worker),
    ] {
        check(pid, part, addr).await;
    }
}

/// The router's data plane probes its clients: keepalive after 60 s of silence, and
/// data left unacknowledged 90 s ends the connection (a client gone without a word
/// does not hold its actor busy for good).
#[tokio::test]
async fn the_data_plane_probes_its_clients() {
    let up = Up::start(&["--workers", "1"]).await;
    let pid = up.child.id().unwrap();
    let client = tokio::net::TcpStream::connect(up.router).await.unwrap();
    let local = client.local_addr().unwrap();
    let server = up.router;
    let (on, idle, user_timeout_ms) = eventually(
        "the router accepted the connection",
        Duration::from_secs(10),
        || async move { accepted_keepalive(pid, server, local) },
    )
    .await;
    assert!(on, "keepalive on");
    assert_eq!(idle, Duration::from_secs(60));
    assert_eq!(user_timeout_ms, 90_000);
    drop(client);
}
