//! Route leases on the router's side, on tokio's paused clock with a scripted control
//! plane: routing from the cache, expiry counted from the request, revocation,
//! renewal of leases in use, and stale use while the control plane is unreachable.

mod common;

use std::time::Duration;

use common::{elapse, harness, settle_until, status};
use tokio::time::Instant;
use valet_router::ActorRef;

const LEASE: Duration = Duration::from_secs(5);

fn actor(a: &str) -> ActorRef {
    a.parse().unwrap()
}

fn watching(h: &common::Harness) {
    h.router
        .route_cache()
        .set_holder(Some(("r1".into(), LEASE)));
}

/// A granted lease routes the actor's requests with no call until it ends, counted
/// from when its request was sent (a slow answer shortens it).
#[tokio::test(start_paused = true)]
async fn a_lease_routes_without_asking_until_it_ends() {
    let mut h = harness(&[]);
    watching(&h);
    let first = h.request("demo/p1");
    let call = h.calls.next().await;
    assert_eq!(call.request.lease_holder.as_deref(), Some("r1"));
    let sent = call.asked_at;
    elapse(Duration::from_secs(1)).await;
    call.running_leased(9001, LEASE, 1);
    assert_eq!(status(&first.await.unwrap()), 200);
    for _ in 0..100 {
        assert_eq!(status(&h.request("demo/p1").await.unwrap()), 200);
    }
    assert!(h.calls.try_next().is_none(), "no call under the lease");
    assert_eq!(
        h.metric("atenet_router_route_cached_total", &[("lease", "valid")]),
        100.0
    );
    let until = sent + LEASE;
    tokio::time::sleep_until(until).await;
    let after = h.request("demo/p1");
    h.calls.next().await.running(9001);
    assert_eq!(status(&after.await.unwrap()), 200);
    assert_eq!(
        Instant::now(),
        until,
        "the lease ended 5 s after it was asked for"
    );
}

/// A revocation drops the lease; an answer granting a lease the revocation covered
/// (it crossed the revoke on the other stream) is not installed.
#[tokio::test(start_paused = true)]
async fn revoked_leases_are_never_used_again() {
    let mut h = harness(&[]);
    watching(&h);
    let r = h.request("demo/p1");
    h.calls.next().await.running_leased(9001, LEASE, 1);
    assert_eq!(status(&r.await.unwrap()), 200);
    let cache = h.router.route_cache().clone();
    let pending = h.request("demo/p2");
    let slow = h.calls.next().await;
    cache_revoke(&cache, "demo/p1", 1);
    cache_revoke(&cache, "demo/p2", 7);
    slow.running_leased(9002, LEASE, 7);
    assert_eq!(status(&pending.await.unwrap()), 200);
    for a in ["demo/p1", "demo/p2"] {
        let r = h.request(a);
        h.calls.next().await.running(9003);
        assert_eq!(status(&r.await.unwrap()), 200, "{a} asked again");
    }
    assert!(cache.route(&actor("demo/p2"), false).is_none());
}

fn cache_revoke(cache: &valet_router::lease::RouteCache, a: &str, through: u64) {
    cache.revoke_for_test(&actor(a), through);
}

/// A lease used since its grant is renewed once, in the background, shortly before it
/// ends; an unused one just ends.
#[tokio::test(start_paused = true)]
async fn leases_in_use_are_renewed_in_the_background() {
    let mut h = harness(&[]);
    watching(&h);
    let _renewals = h.router.start_renewals_only();
    for (a, port) in [("demo/busy", 9001), ("demo/idle", 9002)] {
        let r = h.request(a);
        h.calls.next().await.running_leased(port, LEASE, 1);
        assert_eq!(status(&r.await.unwrap()), 200);
    }
    let start = Instant::now();
    assert_eq!(status(&h.request("demo/busy").await.unwrap()), 200);
    let renewal = h.calls.next().await;
    assert_eq!(renewal.request.actor, actor("demo/busy"));
    assert!(
        start.elapsed() >= Duration::from_secs(3) && start.elapsed() < LEASE,
        "{:?}",
        start.elapsed()
    );
    renewal.running_leased(9001, LEASE, 2);
    settle_until("renewed", || {
        h.metric("atenet_router_leases_renewals_total", &[]) == 1.0
    })
    .await;
    elapse(LEASE).await;
    assert!(
        h.calls.try_next().is_none(),
        "neither the unused nor the renewed-but-unused lease is renewed"
    );
    let r = h.request("demo/busy");
    h.calls.next().await.running(9001);
    assert_eq!(status(&r.await.unwrap()), 200);
}

/// With the control plane unreachable (its watch down, the last call Unavailable), the
/// built-in data plane may use an expired lease for up to --route-stale-max; the Envoy
/// plane never does.
#[tokio::test(start_paused = true)]
async fn stale_leases_only_for_the_built_in_plane_while_unreachable() {
    let mut h = harness(&["--route-stale-max", "10s", "--parked-request-budget", "1s"]);
    watching(&h);
    let r = h.request("demo/p1");
    h.calls.next().await.running_leased(9001, LEASE, 1);
    assert_eq!(status(&r.await.unwrap()), 200);
    elapse(LEASE).await;
    let cache = h.router.route_cache().clone();
    cache.set_holder(None);

    // Reachable (the last call answered): an expired lease is not used.
    let r = h.request_holding("demo/p1");
    h.calls.next().await.fail(tonic::Code::Unavailable, "down");
    settle_until("unreachable", || cache.unreachable()).await;
    // The flight goes on; answer its retries until the budget ends.
    common::answer_until_done(&mut h.calls, r, |c| {
        c.fail(tonic::Code::Unavailable, "down")
    })
    .await;

    // Unreachable: the built-in plane routes under the expired lease...
    let d = h
        .router
        .decide_holding(
            &common::host("demo/p1"),
            Instant::now() + LEASE,
            std::future::pending(),
        )
        .await;
    assert_eq!(status(&d), 200);
    assert_eq!(
        h.metric("atenet_router_route_cached_total", &[("lease", "stale")]),
        1.0
    );
    // ...but Envoy's does not.
    let r = h.request("demo/p1");
    common::answer_until_done(&mut h.calls, r, |c| {
        c.fail(tonic::Code::Unavailable, "down")
    })
    .await;
    // Past the stale window, neither does the built-in plane.
    elapse(Duration::from_secs(10)).await;
    assert!(cache.route(&actor("demo/p1"), true).is_none());
}

/// A renewal that fails is not sent again for that lease (one call per lease period):
/// the lease runs out, and the next request asks for a new one itself. Before, it was
/// sent again at every tick (100 ms) until the lease ended.
#[tokio::test(start_paused = true)]
async fn a_failed_renewal_is_not_sent_again() {
    let mut h = harness(&[]);
    watching(&h);
    let _renewals = h.router.start_renewals_only();
    let r = h.request("demo/busy");
    h.calls.next().await.running_leased(9001, LEASE, 1);
    assert_eq!(status(&r.await.unwrap()), 200);
    assert_eq!(status(&h.request("demo/busy").await.unwrap()), 200);
    let renewal = h.calls.next().await;
    assert_eq!(renewal.request.actor, actor("demo/busy"));
    renewal.fail(tonic::Code::Unavailable, "worker not renewing");
    elapse(LEASE).await;
    assert!(h.calls.try_next().is_none(), "not sent again");
    let r = h.request("demo/busy");
    h.calls.next().await.running(9001);
    assert_eq!(status(&r.await.unwrap()), 200);
}

/// Stopping the lease client does not wait for a renewal the control plane has not
/// answered (it could take the whole attempt timeout, 30 s, past the drain).
#[tokio::test(start_paused = true)]
async fn a_stop_does_not_wait_for_a_pending_renewal() {
    let mut h = harness(&[]);
    watching(&h);
    let renewals = h.router.start_renewals_only();
    let r = h.request("demo/busy");
    h.calls.next().await.running_leased(9001, LEASE, 1);
    assert_eq!(status(&r.await.unwrap()), 200);
    assert_eq!(status(&h.request("demo/busy").await.unwrap()), 200);
    let _pending = h.calls.next().await;
    let stopping = Instant::now();
    tokio::time::timeout(Duration::from_secs(60), renewals.shutdown())
        .await
        .expect("the lease client stopped");
    assert_eq!(stopping.elapsed(), Duration::ZERO, "no wait for the answer");
}
