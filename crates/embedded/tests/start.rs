//! Starting the embedded system: a part that cannot start leaves nothing behind.

use valet_embedded::{Embedded, EmbeddedConfig};

/// An embedded system whose metrics port is taken fails to start and keeps nothing: the data
/// dir can be opened again at once. Before, the control plane it had opened kept the
/// data dir's lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_start_keeps_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut config = EmbeddedConfig::counter(dir.path(), 1);
    config.metrics_listen = Some(taken.local_addr().unwrap());
    let err = Embedded::start(config)
        .await
        .expect_err("the metrics port is taken");
    assert!(err.contains("--metrics-listen"), "{err}");

    let embedded = Embedded::start(EmbeddedConfig::counter(dir.path(), 1))
        .await
        .expect("the data dir is free again");
    embedded.shutdown().await;
}
