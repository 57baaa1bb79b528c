//! `/statusz` rendered by a real headless browser (Debian's chromium, which `.ci/run`
//! installs): the page renders, shows the Request Parking card, and its numbers match
//! `?format=json`.

mod common;

use std::path::Path;
use std::process::Command;

use common::{Up, get_text};

const CHROMIUM: &str = "/usr/bin/chromium";

/// The DOM after the browser rendered `url`.
fn dump_dom(url: &str, profile: &Path) -> String {
    let out = Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            &format!("--user-data-dir={}", profile.display()),
            "--dump-dom",
            url,
        ])
        .output()
        .expect("chromium runs");
    assert!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The text of the element with `id` in a rendered DOM.
fn text_of(dom: &str, id: &str) -> String {
    let marker = format!("id=\"{id}\"");
    let start = dom
        .find(&marker)
        .unwrap_or_else(|| panic!("#{id} missing from the page"));
    let after = &dom[start..];
    let open_end = after.find('>').unwrap() + 1;
    let close = after[open_end..].find('<').unwrap();
    after[open_end..open_end + close].trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statusz_renders_in_a_browser_and_matches_json() {
    assert!(
        Path::new(CHROMIUM).exists(),
        "{CHROMIUM} is missing: .ci/run installs Debian's chromium (apt-get install chromium)"
    );
    let up = Up::start(&[
        "--workers",
        "1",
        "--parked-request-max",
        "1",
        "--parked-request-budget",
        "500ms",
    ])
    .await;
    assert_eq!(get_text(up.router, "p1", "/?token=secret").await.0, 200);
    assert_eq!(get_text(up.router, "p2", "/").await.0, 503);
    assert_eq!(get_text(up.router, "nope", "/").await.0, 404);

    let profile = tempfile::tempdir().unwrap();
    let url = format!("http://{}/statusz", up.admin);
    let dom = tokio::task::spawn_blocking({
        let (url, path) = (url.clone(), profile.path().to_owned());
        move || dump_dom(&url, &path)
    })
    .await
    .unwrap();
    let (_, json) = common::http_get(up.admin, "/statusz?format=json", &[]).await;
    let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    let p = &doc["parking"];

    assert!(
        dom.contains("<h2>Request Parking</h2>"),
        "the parking card renders"
    );
    assert_eq!(text_of(&dom, "parking-enabled"), "enabled");
    assert_eq!(text_of(&dom, "parked"), p["parked"].to_string());
    assert_eq!(text_of(&dom, "parked-max"), p["max"].to_string());
    assert_eq!(text_of(&dom, "parked-max"), "1");
    assert_eq!(
        text_of(&dom, "budget"),
        format!("{} s", p["budget_seconds"])
    );
    assert_eq!(text_of(&dom, "rejected"), p["rejected_total"].to_string());
    assert_eq!(text_of(&dom, "parked-total"), p["parked_total"].to_string());
    assert_eq!(p["parked_total"], 1, "p2 parked once");
    let waits = text_of(&dom, "waits");
    assert!(waits.starts_with("1 waits"), "{waits}");

    let requests = doc["requests"].as_array().unwrap();
    assert_eq!(requests.len(), 3);
    assert_eq!(dom.matches("class=\"request\"").count(), 3);
    assert!(
        !dom.contains("secret") && !json.contains("secret"),
        "query strings are stripped"
    );
    assert_eq!(requests[2]["path"], "/");
    assert_eq!(requests[0]["status"], 404);
}
