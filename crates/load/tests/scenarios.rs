//! A short smoke run of each scenario on embedded parts (few requests, short budgets):
//! the shape of the results, never a wall-clock time.

use std::time::Duration;

use valet_load::scenario;
use valet_load::system::{System, SystemOpts};

const BUDGET: Duration = Duration::from_millis(600);

async fn embedded(workers: usize, capacity_wait: bool, extra: &[&str]) -> System {
    embedded_with_budget(workers, capacity_wait, "600ms", extra).await
}

async fn embedded_with_budget(
    workers: usize,
    capacity_wait: bool,
    budget: &str,
    extra: &[&str],
) -> System {
    let mut router_flags = vec!["--parked-request-budget".to_owned(), budget.to_owned()];
    router_flags.extend(extra.iter().map(|s| (*s).to_owned()));
    System::embedded(&SystemOpts {
        workers,
        restore_delay: Duration::from_millis(10),
        capacity_wait,
        router_flags,
        router_exe: None,
        ..SystemOpts::default()
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeline_shape() {
    for capacity_wait in [true, false] {
        // A budget well above a suspend's worst case on a loaded machine (several
        // fsyncs): the parked request must outlast it to be served.
        let budget = Duration::from_secs(3);
        let sys = embedded_with_budget(2, capacity_wait, "3s", &[]).await;
        let r = scenario::timeline(&sys, budget, 1, Duration::from_millis(200))
            .await
            .unwrap();
        let labels: Vec<(&str, u16)> = r
            .records
            .iter()
            .map(|r| (r.label.as_str(), r.status))
            .collect();
        assert_eq!(
            labels,
            vec![
                ("free-worker", 200),
                ("free-worker", 200),
                ("p3-no-free-worker", 503),
                ("p3-served-after-park", 200),
            ],
            "capacity wait {capacity_wait}"
        );
        assert_eq!(
            r.records[2].body,
            "actor demo/p3 unavailable: no worker has room for the actor"
        );
        assert!(r.records[3].body.starts_with("hello from: demo/p3"));
        assert!(
            r.text.contains("full pool: 1 returned 503 after "),
            "{}",
            r.text
        );
        assert!(
            r.text.contains("ResumeActor calls for that wait: "),
            "{}",
            r.text
        );
        if capacity_wait {
            assert!(
                r.text.contains("ResumeActor calls for that wait: 2"),
                "{}",
                r.text
            );
        }
        sys.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steady_shape() {
    let sys = embedded(2, true, &[]).await;
    let r = scenario::steady(&sys, Duration::from_millis(1500))
        .await
        .unwrap();
    let served = r.records.iter().filter(|r| r.status == 200).count();
    assert!(served >= 4, "{}", r.text);
    assert!(r.records.iter().all(|r| matches!(r.status, 200 | 503)));
    assert!(
        r.text.starts_with("==> results\n    total requests : "),
        "{}",
        r.text
    );
    assert!(r.text.contains("200 latency    : avg "), "{}", r.text);
    sys.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bursts_shape() {
    let sys = embedded(4, true, &[]).await;
    let r = scenario::bursts(&sys, &[1, 2, 4], 2).await.unwrap();
    assert_eq!(r.records.len(), 2 + 4 + 8);
    assert!(
        r.records.iter().all(|r| r.status == 200),
        "a burst that fits is served"
    );
    let lines: Vec<&str> = r.text.lines().collect();
    assert_eq!(lines.len(), 4, "{}", r.text);
    assert!(
        lines[3].trim_start().starts_with("4         8         8"),
        "{}",
        r.text
    );
    sys.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overflow_shape() {
    let sys = embedded(16, true, &[]).await;
    let r = scenario::overflow(&sys, BUDGET, Duration::from_millis(200))
        .await
        .unwrap();
    let first: Vec<_> = r.records.iter().filter(|r| r.label == "burst-32").collect();
    assert_eq!(first.len(), 32);
    assert_eq!(
        first.iter().filter(|r| r.status == 200).count(),
        14,
        "14 free places"
    );
    assert_eq!(first.iter().filter(|r| r.status == 503).count(), 18);
    let second: Vec<_> = r
        .records
        .iter()
        .filter(|r| r.label == "burst-32-relief")
        .collect();
    assert_eq!(second.len(), 32);
    assert!(
        second.iter().filter(|r| r.status == 200).count() > 14,
        "freed workers serve parked requests"
    );
    assert!(
        r.text.contains("burst-32-relief: suspended 16 actors"),
        "{}",
        r.text
    );
    sys.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_scale_shape() {
    let sys = embedded(1, true, &["--parked-request-max", "200"]).await;
    let o = valet_load::parked::ParkedScaleOpts {
        requests: 200,
        actors: 10,
        body: 0,
        budget: BUDGET,
        extproc_requests: 0,
    };
    let r = valet_load::parked::parked_scale(&sys, &o).await.unwrap();
    assert_eq!(r.records.len(), 200);
    assert!(
        r.records.iter().all(|r| r.status == 503),
        "the pool never frees"
    );
    assert!(
        r.records.iter().all(|r| r.body
            == format!(
                "actor {} unavailable: no worker has room for the actor",
                r.actor
            )),
        "each gets the capacity verdict"
    );
    assert!(
        r.text.contains("503 verdicts after their flight's budget"),
        "{}",
        r.text
    );
    sys.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_path_shape() {
    let sys = System::embedded(&SystemOpts {
        workers: 0,
        echo_workers: 1,
        restore_delay: Duration::from_millis(10),
        route_lease: Duration::from_secs(5),
        ..SystemOpts::default()
    })
    .await
    .unwrap();
    let r = scenario::fast_path(&sys, 2, Duration::from_millis(300))
        .await
        .unwrap();
    for side in ["router", "worker"] {
        let n = r
            .records
            .iter()
            .filter(|r| r.label == side && r.status == 200)
            .count();
        assert!(n > 0, "{side}: {}", r.text);
    }
    assert!(
        r.text.contains("router ") && r.text.contains("worker "),
        "{}",
        r.text
    );
    sys.shutdown().await;
}

/// Thirty seconds of the soak: a pool of two saturated by sixteen clients over six
/// actors, a fifth of the requests given up at random, random suspends. The scenario
/// itself fails unless the router's books balance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_books_balance() {
    let sys = System::embedded(&SystemOpts {
        workers: 2,
        restore_delay: Duration::from_millis(10),
        capacity_wait: true,
        router_flags: vec!["--parked-request-budget".into(), "2s".into()],
        router_exe: None,
        ..SystemOpts::default()
    })
    .await
    .unwrap();
    let opts = valet_load::soak::SoakOpts {
        duration: Duration::from_secs(30),
        clients: 16,
        actors: 6,
        budget: Duration::from_secs(2),
        abandon: 0.2,
        suspend_every: Duration::from_millis(300),
    };
    let report = valet_load::soak::soak(&sys, &opts)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    println!("{}", report.text);
    assert!(report.text.contains("books: balanced"), "{}", report.text);
    assert_eq!(report.failed, None);
    assert!(
        report.records.iter().any(|r| r.status == 200)
            && report
                .records
                .iter()
                .any(|r| r.status == 0 && r.body == "abandoned by the client"),
        "served and abandoned requests both happened"
    );
    sys.shutdown().await;
}

/// The eviction scenario in small: two workers full of idle actors, two requests each
/// served after one eviction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_shape() {
    let sys = System::embedded(&SystemOpts {
        workers: 2,
        restore_delay: Duration::from_millis(10),
        router_flags: vec!["--parked-request-budget".into(), "5s".into()],
        evict_idle_after: Duration::from_millis(300),
        ..SystemOpts::default()
    })
    .await
    .unwrap();
    let r = scenario::eviction(&sys, 2, 2, Duration::from_millis(300))
        .await
        .unwrap();
    let served: Vec<u16> = r
        .records
        .iter()
        .filter(|r| r.label == "evicted-for")
        .map(|r| r.status)
        .collect();
    assert_eq!(served, vec![200, 200], "{}", r.text);
    assert!(r.text.contains("evictions: 2"), "{}", r.text);
    sys.shutdown().await;
}

/// The seed's parking demo runs unchanged with a program of the user's as its actors'
/// template: the notes example, restored and stopped for real on every resume and
/// suspend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_parking_demo_runs_with_the_notes_example_as_its_template() {
    let notes =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/notes/app.py");
    let app =
        valet_template::Program::from_command_line(&format!("python3 {}", notes.display()), None)
            .unwrap();
    let sys = System::embedded(&SystemOpts {
        workers: 2,
        restore_delay: Duration::ZERO,
        router_flags: vec!["--parked-request-budget".into(), "3s".into()],
        app: Some(app),
        ..SystemOpts::default()
    })
    .await
    .unwrap();
    let r = scenario::timeline(&sys, Duration::from_secs(3), 1, Duration::from_millis(200))
        .await
        .unwrap();
    let labels: Vec<(&str, u16)> = r
        .records
        .iter()
        .map(|r| (r.label.as_str(), r.status))
        .collect();
    assert_eq!(
        labels,
        vec![
            ("free-worker", 200),
            ("free-worker", 200),
            ("p3-no-free-worker", 503),
            ("p3-served-after-park", 200),
        ],
        "{}",
        r.text
    );
    assert_eq!(r.records[3].body, "no notes yet", "the notes app answered");
    let r = scenario::steady(&sys, Duration::from_millis(1500))
        .await
        .unwrap();
    assert!(
        r.records.iter().filter(|r| r.status == 200).count() >= 4,
        "{}",
        r.text
    );
    sys.shutdown().await;
}
