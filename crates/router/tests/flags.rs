//! Router flags parsed by an embedder: with the `VALET_…` variables (a router
//! started by hand) and without them (a benchmark's own router, which a variable left
//! in the shell must not change).

use std::time::Duration;

use valet_router::config::RouterArgs;

/// Set in the child process this test runs itself in.
const CHILD: &str = "VALET_ROUTER_FLAGS_TEST_CHILD";

#[test]
fn flags_only_leave_the_environment_out() {
    if std::env::var_os(CHILD).is_none() {
        // The same test again, in a process of its own whose environment has the
        // variable (this process's environment is left alone).
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "flags_only_leave_the_environment_out"])
            .env(CHILD, "1")
            .env("VALET_PARKED_REQUEST_BUDGET", "1s")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("1 passed"),
            "the child ran the test: {stdout}"
        );
        return;
    }
    let none = std::iter::empty::<&str>();
    assert_eq!(
        RouterArgs::try_parse_flags(none.clone())
            .unwrap()
            .parking
            .parked_request_budget,
        Duration::from_secs(1),
        "a router started by hand reads the variable"
    );
    assert_eq!(
        RouterArgs::try_parse_flags_only(none)
            .unwrap()
            .parking
            .parked_request_budget,
        Duration::from_secs(5),
        "the default, not the variable"
    );
    assert_eq!(
        RouterArgs::try_parse_flags_only(["--parked-request-budget", "2s"])
            .unwrap()
            .parking
            .parked_request_budget,
        Duration::from_secs(2)
    );
}
