//! The pipeline's cost per decision for a running actor (the fast path), against an
//! in-process control plane that answers at once, and for a leased actor (routed from
//! the route cache with no control-plane call). One current-thread runtime: the figure
//! is decisions per second on one core.
//!
//! `cargo bench -p valet-router --bench decision`

use std::sync::Arc;
use std::time::Duration;

use divan::Bencher;
use divan::counter::ItemsCount;
use valet_router::testing::{AlwaysLeased, AlwaysRunning};
use valet_router::{Decision, Metrics, Router, RouterArgs};

fn main() {
    divan::main();
}

fn router() -> Router {
    let config = RouterArgs::try_parse_flags(std::iter::empty::<&str>())
        .unwrap()
        .resolve()
        .unwrap();
    Router::new(
        Arc::new(config),
        Arc::new(AlwaysRunning { port: 9000 }),
        Arc::new(Metrics::new()),
    )
}

/// One request at a time, each to a running actor.
#[divan::bench]
fn running_actor(bencher: Bencher) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let router = router();
    let host = "p1.demo.actors.resources.substrate.ate.dev";
    bencher.counter(ItemsCount::new(1usize)).bench_local(|| {
        rt.block_on(async {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            let d = router.decide(host, deadline).await;
            assert!(matches!(d, Decision::Route(_)));
        })
    });
}

/// 64 requests in flight at once over 16 actors, on the same single thread.
#[divan::bench]
fn running_actors_concurrent(bencher: Bencher) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let router = router();
    let hosts: Vec<String> = (0..16)
        .map(|i| format!("a{i}.demo.actors.resources.substrate.ate.dev"))
        .collect();
    bencher.counter(ItemsCount::new(64usize)).bench_local(|| {
        rt.block_on(async {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            let mut set = tokio::task::JoinSet::new();
            for i in 0..64 {
                let router = router.clone();
                let host = hosts[i % hosts.len()].clone();
                set.spawn(async move { router.decide(&host, deadline).await });
            }
            while let Some(d) = set.join_next().await {
                assert!(matches!(d.unwrap(), Decision::Route(_)));
            }
        })
    });
}

/// One request at a time, each to a running actor with a route lease: the route cache.
#[divan::bench]
fn leased_actor(bencher: Bencher) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let config = RouterArgs::try_parse_flags(std::iter::empty::<&str>())
        .unwrap()
        .resolve()
        .unwrap();
    let lease = Duration::from_secs(3600);
    let router = Router::new(
        Arc::new(config),
        Arc::new(AlwaysLeased { port: 9000, lease }),
        Arc::new(Metrics::new()),
    );
    router
        .route_cache()
        .set_holder(Some(("bench".into(), lease)));
    let host = "p1.demo.actors.resources.substrate.ate.dev";
    rt.block_on(async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        router.decide(host, deadline).await;
    });
    // A thousand decisions per runtime entry, as a data plane's task makes them.
    bencher.counter(ItemsCount::new(1000usize)).bench_local(|| {
        rt.block_on(async {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            for _ in 0..1000 {
                let d = router.decide(host, deadline).await;
                assert!(matches!(d, Decision::Route(_)));
            }
        })
    });
}
