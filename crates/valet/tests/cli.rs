//! The `valet` binary's command line: exit statuses, one-line errors, `--help`, and
//! the `VALET_…` environment variables.

use std::process::{Command, Output};

fn valet(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_valet"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("valet runs")
}

fn stderr_lines(o: &Output) -> Vec<String> {
    String::from_utf8_lossy(&o.stderr)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect()
}

#[test]
fn invalid_configuration_exits_64_with_one_line() {
    let o = valet(&["router", "--parked-request-retry-factor", "0.5"], &[]);
    assert_eq!(o.status.code(), Some(64));
    assert_eq!(
        stderr_lines(&o),
        vec![
            "valet router: invalid configuration: --parked-request-retry-factor=0.5: must be >= 1"
        ]
    );
}

#[test]
fn unparsable_value_exits_64_with_one_line_naming_flag_and_value() {
    let o = valet(&["router", "--parked-request-budget", "five"], &[]);
    assert_eq!(o.status.code(), Some(64));
    let lines = stderr_lines(&o);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("--parked-request-budget"), "{}", lines[0]);
    assert!(lines[0].contains("five"), "{}", lines[0]);
}

#[test]
fn explicit_breaker_below_the_lot_is_refused() {
    let o = valet(
        &[
            "router",
            "--parked-request-max",
            "2000",
            "--extproc-max-requests",
            "1500",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(64));
    assert_eq!(
        stderr_lines(&o),
        vec![
            "valet router: invalid configuration: --extproc-max-requests=1500: must be >= --parked-request-max (2000), or 0 to derive it"
        ]
    );
}

#[test]
fn environment_variables_configure_the_router() {
    let o = valet(&["router"], &[("VALET_PARKED_REQUEST_BUDGET", "0s")]);
    assert_eq!(o.status.code(), Some(64));
    assert!(stderr_lines(&o)[0].contains("--parked-request-budget=0s: must be > 0"));

    let o = valet(
        &["router", "--check"],
        &[
            ("VALET_PARKED_REQUEST_MAX", "3000"),
            ("VALET_DRAIN_DELAY", "2s"),
        ],
    );
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("--parked-request-max=3000"), "{out}");
    assert!(out.contains("--extproc-max-requests=6000"), "{out}");
    assert!(out.contains("--drain-delay=2s"), "{out}");
    assert!(out.contains("--drain-timeout=10s"), "{out}");
}

#[test]
fn help_lists_every_flag_with_default_and_variable() {
    let o = valet(&["router", "--help"], &[]);
    assert_eq!(o.status.code(), Some(0));
    let help = String::from_utf8_lossy(&o.stdout);
    for (flag, default) in [
        ("--listen", "0.0.0.0:8080"),
        ("--extproc-listen", "0.0.0.0:50051"),
        ("--admin-listen", "127.0.0.1:4040"),
        ("--control-plane", "http://127.0.0.1:7070"),
        ("--actor-domain", "actors.resources.substrate.ate.dev"),
        ("--worker-port", "80"),
        ("--parked-request-budget", "5s"),
        ("--parked-request-max", "1024"),
        ("--parked-request-retry-interval", "100ms"),
        ("--parked-request-retry-factor", "1.1"),
        ("--parked-request-retry-jitter", "0.1"),
        ("--extproc-max-requests", "0"),
        ("--resume-attempt-timeout", "30s"),
        ("--parked-request-max-body", "1MiB"),
        ("--parked-bytes-max", "64MiB"),
        ("--drain-delay", "0s"),
        ("--drain-timeout", "0s"),
    ] {
        let var = format!(
            "VALET_{}",
            flag.trim_start_matches("--")
                .replace('-', "_")
                .to_uppercase()
        );
        let block = flag_block(&help, flag);
        assert!(
            block.contains(&format!("[default: {default}]")),
            "{flag}: {block}"
        );
        assert!(block.contains(&format!("[env: {var}=")), "{flag}: {block}");
    }
}

/// `envoy-bootstrap`'s ingress flags describe Envoy's own HTTPS listener: Envoy reads
/// the certificate files, so they are required there. Before, its help promised the
/// router's generated certificate, which the command refuses (exit 64).
#[test]
fn envoy_bootstrap_help_describes_envoys_https_listener() {
    let o = valet(&["envoy-bootstrap", "--help"], &[]);
    assert_eq!(o.status.code(), Some(0));
    let help = String::from_utf8_lossy(&o.stdout);
    let cert = flag_block(&help, "--ingress-tls-cert-file");
    assert!(!cert.contains("self-signed"), "{cert}");
    assert!(cert.contains("required with --listen-https"), "{cert}");
    let ca = flag_block(&help, "--ingress-client-ca-file");
    assert!(ca.contains("Envoy's HTTPS listener"), "{ca}");
    assert!(!ca.contains("--extproc-listen"), "{ca}");
    let o = valet(
        &["envoy-bootstrap", "--listen-https", "127.0.0.1:8443"],
        &[],
    );
    assert_eq!(o.status.code(), Some(64));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--ingress-tls-cert-file"), "{err}");
}

/// Every subcommand's `--help` gives the default of every flag that takes a value
/// (spec/cli.md), `[default: none]` for one that is off until given. Walks the whole
/// command tree from `valet --help`. Before, about sixty optional flags showed none.
#[test]
fn every_flag_of_every_subcommand_shows_its_default() {
    fn subcommands(help: &str) -> Vec<String> {
        help.lines()
            .skip_while(|l| !l.starts_with("Commands:"))
            .skip(1)
            .take_while(|l| l.starts_with("  "))
            .filter_map(|l| l.split_whitespace().next())
            .filter(|c| *c != "help")
            .map(str::to_owned)
            .collect()
    }
    let mut todo = vec![Vec::<String>::new()];
    let mut checked = 0;
    while let Some(path) = todo.pop() {
        let mut args: Vec<&str> = path.iter().map(String::as_str).collect();
        args.push("--help");
        let o = valet(&args, &[]);
        assert_eq!(o.status.code(), Some(0), "{path:?}");
        let help = String::from_utf8_lossy(&o.stdout).into_owned();
        for sub in subcommands(&help) {
            let mut next = path.clone();
            next.push(sub);
            todo.push(next);
        }
        // Required flags (named in the usage line) have no default to give.
        let usage = help.lines().find(|l| l.starts_with("Usage:")).unwrap_or("");
        let flags = help.lines().filter_map(|l| {
            let t = l.trim_start();
            (t.starts_with("--") && l.len() - t.len() < 8 && t.contains(" <"))
                .then(|| t.split_whitespace().next().unwrap().to_owned())
                .filter(|f| !usage.contains(&format!("{f} <")))
        });
        for flag in flags {
            let block = flag_block(&help, &flag);
            assert!(
                block.contains("[default: ") || block.to_lowercase().contains("default: "),
                "valet {} {flag}: {block}",
                path.join(" ")
            );
            // A flag whose help speaks of its default never also says it has none.
            assert!(
                !(block.contains("[default: none]")
                    && block.to_lowercase().matches("default").count() > 1),
                "valet {} {flag}: {block}",
                path.join(" ")
            );
            checked += 1;
        }
    }
    assert!(checked > 200, "only {checked} flags seen");
}

/// The lines of `--help` that describe `flag`.
fn flag_block(help: &str, flag: &str) -> String {
    let mut block = String::new();
    let mut inside = false;
    for line in help.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        // Flag lines are indented less than their (possibly wrapped) descriptions.
        if trimmed.starts_with('-') && indent < 8 {
            // `-j, --json …`: the long name after a short one.
            let long = trimmed
                .split_once(", ")
                .filter(|(short, _)| !short.starts_with("--"))
                .map_or(trimmed, |(_, long)| long);
            inside = long == flag || long.starts_with(&format!("{flag} "));
        }
        if inside {
            block.push_str(line);
            block.push('\n');
        }
    }
    assert!(!block.is_empty(), "{flag} missing from --help:\n{help}");
    // Help wraps with the terminal's width; compare with whitespace folded.
    block.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn no_subcommand_is_a_usage_error() {
    let o = valet(&[], &[]);
    assert_eq!(o.status.code(), Some(64));
}

#[test]
fn envoy_bootstrap_refuses_a_breaker_below_the_lot() {
    let o = valet(
        &[
            "envoy-bootstrap",
            "--parked-request-max",
            "2000",
            "--extproc-max-requests",
            "1500",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(64));
    assert_eq!(
        stderr_lines(&o),
        vec![
            "valet envoy-bootstrap: invalid configuration: --extproc-max-requests=1500: must be >= --parked-request-max (2000), or 0 to derive it"
        ]
    );
    let o = valet(&["envoy-bootstrap", "--parked-request-max", "2000"], &[]);
    assert_eq!(o.status.code(), Some(0));
    let yaml = String::from_utf8(o.stdout).unwrap();
    assert!(yaml.contains("max_requests: 4000"), "{yaml}");
    assert!(yaml.contains("message_timeout: 10s"), "{yaml}");
}

#[test]
fn load_processes_flags_are_checked_before_anything_starts() {
    let o = valet(&["load", "scenario", "parked-scale", "--processes"], &[]);
    assert_eq!(o.status.code(), Some(64));
    assert_eq!(
        stderr_lines(&o),
        vec![
            "valet load: invalid configuration: --processes: runs timeline, steady, bursts and overflow, not parked-scale"
        ]
    );
    let o = valet(
        &[
            "load",
            "scenario",
            "overflow",
            "--processes",
            "--database",
            "mysql://db",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(64));
    assert_eq!(
        stderr_lines(&o),
        vec!["valet load: invalid configuration: --database: must be a postgres:// URL"]
    );
    // --database needs --processes; --processes excludes --router.
    let o = valet(
        &[
            "load",
            "scenario",
            "overflow",
            "--database",
            "postgres://db",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(64));
    let lines = stderr_lines(&o);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("--processes"), "{}", lines[0]);
    let o = valet(
        &[
            "load",
            "scenario",
            "overflow",
            "--processes",
            "--router",
            "127.0.0.1:1",
            "--control-plane",
            "http://127.0.0.1:2",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(64));
    let lines = stderr_lines(&o);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("--processes") && lines[0].contains("--router"),
        "{}",
        lines[0]
    );
}

/// The spec's rule (`cli.md`): every flag of every subcommand (nested ones too) has a
/// `VALET_…` environment variable, shown in `--help`.
#[test]
fn every_flag_of_every_subcommand_has_a_variable() {
    let mut missing = Vec::new();
    let mut visited = 0;
    let mut todo: Vec<Vec<String>> = vec![Vec::new()];
    while let Some(sub) = todo.pop() {
        let mut args: Vec<&str> = sub.iter().map(String::as_str).collect();
        args.push("--help");
        let o = valet(&args, &[]);
        assert_eq!(o.status.code(), Some(0), "{args:?}");
        let help = String::from_utf8_lossy(&o.stdout).into_owned();
        visited += 1;
        // Its subcommands: the lines under `Commands:`, up to a blank line.
        let mut in_commands = false;
        for line in help.lines() {
            if line.starts_with("Commands:") {
                in_commands = true;
                continue;
            }
            if in_commands {
                match line.split_whitespace().next() {
                    None => in_commands = false,
                    Some("help") => {}
                    Some(name) => {
                        let mut next = sub.clone();
                        next.push(name.to_owned());
                        todo.push(next);
                    }
                }
            }
        }
        let flags: Vec<String> = help
            .lines()
            .filter_map(|line| {
                let trimmed = line.trim_start();
                let indent = line.len() - trimmed.len();
                (indent < 8 && trimmed.starts_with('-')).then(|| {
                    // `-h, --help`, `--listen <ADDR>`: the long name.
                    trimmed
                        .split([' ', ','])
                        .find(|w| w.starts_with("--"))
                        .unwrap_or(trimmed)
                        .to_owned()
                })
            })
            .filter(|f| f != "--help" && f != "--version")
            .collect();
        for flag in flags {
            if !flag_block(&help, &flag).contains("[env: VALET_") {
                missing.push(format!("{} {flag}", sub.join(" ")));
            }
        }
    }
    assert!(visited > 20, "walked only {visited} help pages");
    assert!(missing.is_empty(), "flags without a variable: {missing:?}");
}

/// `valet ctl`'s control-plane flags go before or after its subcommand alike: the
/// same one-line configuration error either way (the CA file is missing), never
/// clap's "unexpected argument".
#[test]
fn ctl_takes_its_control_plane_flags_after_the_subcommand() {
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("missing-ca.pem");
    let ca = ca.to_str().unwrap();
    let flags = [
        "--control-plane",
        "https://127.0.0.1:1",
        "--ateapi-ca-file",
        ca,
    ];
    let before: Vec<&str> = ["ctl"]
        .into_iter()
        .chain(flags)
        .chain(["actor", "get", "demo/p1"])
        .collect();
    let after: Vec<&str> = ["ctl", "actor", "get", "demo/p1"]
        .into_iter()
        .chain(flags)
        .collect();
    let (before, after) = (valet(&before, &[]), valet(&after, &[]));
    assert_eq!(stderr_lines(&after), stderr_lines(&before));
    assert_eq!(after.status.code(), before.status.code());
    let lines = stderr_lines(&after);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].starts_with(&format!(
            "valet ctl: invalid configuration: --ateapi-ca-file={ca}: "
        )),
        "{lines:?}"
    );
}

/// `valet up`'s help shows the defaults it uses (its listeners on loopback) and no
/// `--control-plane` (it runs its own): one given is refused, and a
/// `VALET_CONTROL_PLANE` meant for `valet ctl` is not read.
#[test]
fn up_shows_its_own_defaults_and_takes_no_control_plane() {
    let o = valet(&["up", "--help"], &[("VALET_CONTROL_PLANE", "http://x:1")]);
    assert_eq!(o.status.code(), Some(0));
    let help = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(flag_block(&help, "--listen").contains("[default: 127.0.0.1:8080]"));
    assert!(flag_block(&help, "--extproc-listen").contains("[default: 127.0.0.1:50051]"));
    assert!(!help.contains("--control-plane <"), "{help}");
    let o = valet(&["up", "--control-plane", "http://127.0.0.1:1"], &[]);
    assert_eq!(o.status.code(), Some(64));
    assert_eq!(
        stderr_lines(&o),
        vec![
            "valet up: invalid configuration: --control-plane=http://127.0.0.1:1: valet up runs its own control plane (see --control-plane-listen)"
        ]
    );
}

/// A load scenario's target takes URLs, checked before anything starts.
#[test]
fn load_targets_are_urls_checked_at_start() {
    for (args, line) in [
        (
            [
                "--router",
                "https://127.0.0.1:1",
                "--control-plane",
                "http://127.0.0.1:1",
            ],
            "error: invalid value 'https://127.0.0.1:1' for '--router <URL>': the load client speaks plain HTTP: give http://host:port",
        ),
        (
            [
                "--router",
                "http://127.0.0.1:1",
                "--control-plane",
                "127.0.0.1:1",
            ],
            "error: invalid value '127.0.0.1:1' for '--control-plane <URL>': must be http://<host>:<port> (h2c) or https://<host>:<port> (TLS)",
        ),
    ] {
        let mut all = vec!["load", "scenario", "steady"];
        all.extend(args);
        let o = valet(&all, &[]);
        assert_eq!(o.status.code(), Some(64), "{all:?}");
        assert_eq!(stderr_lines(&o).first().map(String::as_str), Some(line));
    }
}

/// An open-loop rate that is not a finite positive number, or that would schedule more
/// requests than a run keeps in memory, is refused before anything is sent.
#[test]
fn load_run_rates_are_checked() {
    for (rate, duration, line) in [
        (
            "0",
            "1s",
            "valet load: invalid configuration: --rate=0: must be a finite number > 0",
        ),
        (
            "inf",
            "1s",
            "valet load: invalid configuration: --rate=inf: must be a finite number > 0",
        ),
        (
            "1000000",
            "3600s",
            "valet load: invalid configuration: --rate=1000000 with --duration=3600s: at most 10000000 requests in one run",
        ),
    ] {
        let o = valet(
            &[
                "load",
                "run",
                "--router",
                "127.0.0.1:1",
                "--actors",
                "demo/p1",
                "--rate",
                rate,
                "--duration",
                duration,
            ],
            &[],
        );
        assert_eq!(o.status.code(), Some(64), "--rate {rate}");
        assert_eq!(stderr_lines(&o).first().map(String::as_str), Some(line));
    }
    for (flags, line) in [
        (
            &["--duration", "0s"][..],
            "valet load: invalid configuration: --duration=0s: must be > 0",
        ),
        (
            &["--path", "foo"],
            "valet load: invalid configuration: --path=foo: must start with / and hold no spaces",
        ),
    ] {
        let mut args = vec![
            "load",
            "run",
            "--router",
            "127.0.0.1:1",
            "--actors",
            "demo/p1",
        ];
        args.extend_from_slice(flags);
        let o = valet(&args, &[]);
        assert_eq!(o.status.code(), Some(64), "{flags:?}");
        assert_eq!(stderr_lines(&o).first().map(String::as_str), Some(line));
    }
}

/// A run against a router that never answers (nothing listens there) says so and
/// exits 1 after its summary: before, it printed "N requests (error: N)" and exited 0,
/// which a script took for a measurement.
#[test]
fn a_load_run_with_no_answer_fails() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let router = closed.to_string();
    let o = valet(
        &["load", "run", "--router", &router, "--duration", "300ms"],
        &[],
    );
    assert_eq!(o.status.code(), Some(1));
    let lines = stderr_lines(&o);
    let last = lines.last().unwrap();
    assert!(
        last.starts_with("valet load: none of the ")
            && last.contains(&format!("got an HTTP answer from --router={router}")),
        "{lines:?}"
    );
}

/// A hosting lease too short for the workers' renewals every second (the control plane
/// would answer `Unavailable` for a running actor between renewals) is refused, by the
/// control plane and by `valet up`.
#[test]
fn a_hosting_lease_below_4s_is_refused() {
    for cmd in ["control-plane", "up"] {
        for lease in ["0", "3s"] {
            let o = valet(&[cmd, "--hosting-lease", lease], &[]);
            assert_eq!(o.status.code(), Some(64), "{cmd} {lease}");
            let lines = stderr_lines(&o);
            assert_eq!(lines.len(), 1, "{lines:?}");
            assert!(
                lines[0].contains("--hosting-lease") && lines[0].contains("at least 4s"),
                "{}",
                lines[0]
            );
        }
    }
}

/// `valet up` refuses, before it starts anything, a control-plane setting its own
/// workers could not meet (they present the router's credentials): bearer tokens
/// without `--ateapi-auth jwt`, client certificates without `--ateapi-cert-file`.
/// Before, it waited 20 s for workers that never joined, then exited 1.
#[test]
fn valet_up_refuses_control_plane_auth_its_workers_cannot_meet() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let data = data.to_str().unwrap();
    for (flags, named) in [
        (
            &[
                "--jwt-public-key-file",
                "k.pem",
                "--jwt-audience",
                "a",
                "--jwt-issuer",
                "i",
            ][..],
            "--ateapi-token-file",
        ),
        (
            &[
                "--client-ca-file",
                "ca.pem",
                "--tls-cert-file",
                "c.pem",
                "--tls-key-file",
                "k.pem",
            ][..],
            "--ateapi-cert-file",
        ),
    ] {
        let mut args = vec!["up", "--tls", "--data-dir", data];
        args.extend_from_slice(flags);
        let o = valet(&args, &[]);
        assert_eq!(o.status.code(), Some(64), "{flags:?}");
        let lines = stderr_lines(&o);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains(named), "{}", lines[0]);
    }
    assert!(!dir.path().join("data").exists(), "nothing written");
}

/// `valet ctl` refuses an actor without an atespace or a name, and a page size below
/// 1, itself (exit 64), before asking any server.
#[test]
fn ctl_checks_its_arguments_before_asking() {
    let nowhere = "http://127.0.0.1:9";
    for args in [
        &["ctl", "--control-plane", nowhere, "actor", "get", "demo/"][..],
        &["ctl", "--control-plane", nowhere, "actor", "get", "/p1"][..],
        &[
            "ctl",
            "--control-plane",
            nowhere,
            "actor",
            "list",
            "--page-size",
            "0",
        ][..],
    ] {
        let o = valet(args, &[]);
        assert_eq!(o.status.code(), Some(64), "{args:?}");
        assert_eq!(stderr_lines(&o).len(), 1, "{args:?}");
    }
}

/// A `valet ctl` call that got no answer within `--timeout` is reported as such and
/// never sent to the next replica (the first may still carry it out); one that cannot
/// connect is.
#[test]
fn ctl_fails_over_only_when_a_replica_cannot_be_reached() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    // A replica that accepts and never answers, and one that counts its connections.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in silent.incoming() {
            held.push(c);
        }
    });
    let counting = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let counting_addr = counting.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&connections);
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for c in counting.incoming() {
            seen.fetch_add(1, Ordering::SeqCst);
            held.push(c);
        }
    });
    let both = format!("http://{silent_addr},http://{counting_addr}");
    let o = valet(
        &[
            "ctl",
            "--control-plane",
            &both,
            "--timeout",
            "1s",
            "atespace",
            "list",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(1));
    let lines = stderr_lines(&o);
    assert!(
        lines.len() == 1
            && lines[0].contains("DEADLINE_EXCEEDED")
            && lines[0].contains("--timeout"),
        "{lines:?}"
    );
    assert_eq!(
        connections.load(Ordering::SeqCst),
        0,
        "not asked of the next replica"
    );

    // A replica that refuses connections is passed over.
    let refused = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let refused_addr = refused.local_addr().unwrap();
    drop(refused);
    let both = format!("http://{refused_addr},http://{counting_addr}");
    let o = valet(
        &[
            "ctl",
            "--control-plane",
            &both,
            "--timeout",
            "1s",
            "atespace",
            "list",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(1), "{:?}", stderr_lines(&o));
    assert!(
        connections.load(Ordering::SeqCst) >= 1,
        "the next replica was asked"
    );
}

/// A scenario says it is still running every 5 s (its report comes only at the end).
#[test]
fn a_long_scenario_prints_progress() {
    let out = tempfile::tempdir().unwrap();
    let o = valet(
        &[
            "load",
            "scenario",
            "steady",
            "--capacity-wait",
            "on",
            "--duration",
            "6s",
            "--restore-delay",
            "10ms",
            "--out",
            out.path().to_str().unwrap(),
        ],
        &[],
    );
    assert!(o.status.success(), "{:?}", stderr_lines(&o));
    let lines = stderr_lines(&o);
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("valet load scenario steady-capacity-wait-on: running for ")),
        "{lines:?}"
    );
}

/// The load scenarios' counts must be at least 1 (exit 64 naming the flag): before,
/// `soak --actors 0` panicked in every client and `eviction --runs 0` exited 1.
#[test]
fn load_scenario_counts_are_at_least_one() {
    for flag in [
        "--actors",
        "--runs",
        "--workers",
        "--requests",
        "--parked-actors",
    ] {
        let o = valet(&["load", "scenario", "soak", flag, "0"], &[]);
        assert_eq!(o.status.code(), Some(64), "{flag}");
        let lines = stderr_lines(&o);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].contains(flag) && lines[0].contains("at least 1"),
            "{}",
            lines[0]
        );
    }
}

/// Values the load tool would pass on to parts it starts, or send, refused at once
/// with the flag the user gave: before, `--budget 0s` failed after the parts started,
/// naming the router's `--parked-request-budget` (exit 1); `--evict-idle-after 0` ran
/// the eviction scenario with eviction off; `--actors p1` sent every request with the
/// host `p1` (404s, exit 0).
#[test]
fn load_values_are_checked_before_anything_starts() {
    let cases: &[(&[&str], &str, &str)] = &[
        (
            &["load", "scenario", "timeline", "--budget", "0s"],
            "--budget",
            "must be > 0",
        ),
        (
            &["demo", "parking", "--budget", "0s"],
            "--budget",
            "must be > 0",
        ),
        (
            &["load", "scenario", "eviction", "--evict-idle-after", "0"],
            "--evict-idle-after",
            "must be > 0",
        ),
        (
            &["load", "run", "--actors", "p1"],
            "--actors",
            "want <atespace>/<name>",
        ),
        (
            &["load", "run", "--actors", "demo/p1,"],
            "--actors",
            "want <atespace>/<name>",
        ),
    ];
    for &(args, flag, rule) in cases {
        let o = valet(args, &[]);
        assert_eq!(o.status.code(), Some(64), "{args:?}");
        let lines = stderr_lines(&o);
        assert_eq!(lines.len(), 1, "{args:?}: {lines:?}");
        assert!(
            lines[0].contains(flag) && lines[0].contains(rule),
            "{args:?}: {}",
            lines[0]
        );
    }
}

/// `valet up --check`, as `valet router --check`, prints the router's effective flags
/// and exits 0 without starting or writing anything; a bad value is exit 64.
#[test]
fn valet_up_check_prints_the_effective_flags_and_starts_nothing() {
    // The HTTPS listener's flags are effective flags too (on /statusz as well).
    let o = valet(
        &[
            "router",
            "--check",
            "--control-plane",
            "http://127.0.0.1:7070",
            "--listen-https",
            "127.0.0.1:0",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.lines().any(|l| l == "--listen-https=127.0.0.1:0"),
        "{out}"
    );

    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let o = valet(
        &[
            "up",
            "--check",
            "--data-dir",
            data.to_str().unwrap(),
            "--parked-request-max",
            "7",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(0), "{o:?}");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.lines().any(|l| l == "--parked-request-max=7"), "{out}");
    assert!(!data.exists(), "nothing written");
    for bad in [
        &["--parked-request-budget", "0s"][..],
        &["--metrics-listen", "bogus"][..],
    ] {
        let mut args = vec!["up", "--check"];
        args.extend_from_slice(bad);
        assert_eq!(valet(&args, &[]).status.code(), Some(64), "{bad:?}");
    }
}

/// A mistake in a router flag given to `valet up` is found before the data dir is
/// touched: one line, exit 64, nothing written, and the flag named even while another
/// `valet up` holds the dir (before, the lock was taken first: "in use", exit 1).
#[test]
fn valet_up_checks_its_flags_before_the_data_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    let o = valet(
        &[
            "up",
            "--data-dir",
            data.to_str().unwrap(),
            "--parked-request-budget",
            "0",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(64));
    let lines = stderr_lines(&o);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("--parked-request-budget=0s"), "{lines:?}");
    assert!(!data.exists(), "nothing written");
    // The same for the HTTPS listener's flags, and for control-plane TLS flags that
    // the embedded control plane cannot meet (it serves plaintext without --tls).
    for (flags, named) in [
        (
            &[
                "--listen-https",
                "127.0.0.1:0",
                "--ingress-allowed-spiffe-ids",
                "spiffe://td/x",
            ][..],
            "--ingress-allowed-spiffe-ids=spiffe://td/x",
        ),
        (&["--ateapi-ca-file", "/etc/hosts"][..], "needs --tls"),
        // With --tls too, whose certificates are made later: before, the data dir was
        // written first.
        (
            &["--tls", "--listen-https", "nonsense"][..],
            "--listen-https=nonsense",
        ),
        // With --tls, the router's credential flags are checked against each other
        // before the throwaway CA is made (before, the data dir was written first).
        (
            &["--tls", "--ateapi-auth", "jwt"][..],
            "--ateapi-auth=jwt: needs --ateapi-token-file",
        ),
        // A value read from a file ends in a newline: shown escaped, on one line.
        (
            &["--listen-https", "127.0.0.1:8443\n"][..],
            "--listen-https=127.0.0.1:8443\\n: must be <ip>:<port>",
        ),
        // Two listeners on one address: before, the control plane started and wrote
        // the actors, then the router's bind failed (exit 1).
        (
            &["--admin-listen", "127.0.0.1:8080"][..],
            "--admin-listen=127.0.0.1:8080: --listen listens there already",
        ),
        (
            &["--metrics-listen", "0.0.0.0:8080"][..],
            "--listen=127.0.0.1:8080: --metrics-listen listens there already",
        ),
        // A rule between two flags names the value of the one it refuses.
        (
            &["--client-ca-file", "/etc/valet/clients.pem"][..],
            "--client-ca-file=/etc/valet/clients.pem: the embedded control plane then asks for client certificates",
        ),
    ] {
        let mut args = vec!["up", "--data-dir", data.to_str().unwrap()];
        args.extend_from_slice(flags);
        let o = valet(&args, &[]);
        assert_eq!(o.status.code(), Some(64), "{flags:?}");
        let lines = stderr_lines(&o);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains(named), "{lines:?}");
        assert!(!lines[0].contains("--control-plane"), "{lines:?}");
        assert!(!data.exists(), "nothing written");
    }
    // The same rule for the control plane's and the router's own listeners.
    for (args, named) in [
        (
            &[
                "control-plane",
                "--data-dir",
                data.to_str().unwrap(),
                "--listen",
                "127.0.0.1:7070",
                "--metrics-listen",
                "127.0.0.1:7070",
            ][..],
            "--metrics-listen=127.0.0.1:7070: --listen listens there already",
        ),
        (
            &[
                "router",
                "--control-plane",
                "http://127.0.0.1:7070",
                "--listen-https",
                "127.0.0.1:8080",
                "--check",
            ][..],
            "--listen-https=127.0.0.1:8080: --listen listens there already",
        ),
    ] {
        let o = valet(args, &[]);
        assert_eq!(o.status.code(), Some(64), "{args:?}");
        let lines = stderr_lines(&o);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].contains(named), "{lines:?}");
        assert!(!data.exists(), "nothing written");
    }
}

/// A port `valet up` needs that is taken (another `valet up` on another data dir,
/// say) exits 1 naming its flag, before the data dir is touched. Before, the control
/// plane started, the actors were written, and only then the router's port failed.
#[test]
fn valet_up_checks_its_ports_before_the_data_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let o = valet(
        &[
            "up",
            "--data-dir",
            data.to_str().unwrap(),
            "--control-plane-listen",
            "127.0.0.1:0",
            "--listen",
            &addr,
            "--extproc-listen",
            "",
            "--admin-listen",
            "",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(1));
    let lines = stderr_lines(&o);
    assert!(
        lines
            .iter()
            .any(|l| l.contains(&format!("cannot listen on --listen={addr}"))),
        "{lines:?}"
    );
    assert!(!data.exists(), "nothing written");
}

/// `valet control-plane --client-ca-file` without a certificate of its own: one line
/// naming the flag and the rule.
#[test]
fn a_client_ca_needs_a_server_certificate() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    let o = valet(
        &[
            "control-plane",
            "--data-dir",
            data.to_str().unwrap(),
            "--client-ca-file",
            "/etc/hosts",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(64));
    let lines = stderr_lines(&o);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("--client-ca-file=/etc/hosts: needs --tls-cert-file"),
        "{lines:?}"
    );
}

/// With `valet up --tls`, a --client-ca-file (which goes with the throwaway
/// certificate) is checked before the data dir is touched too.
#[test]
fn valet_up_checks_its_client_ca_before_the_data_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("d");
    let missing = tmp.path().join("missing-ca.pem");
    let o = valet(
        &[
            "up",
            "--tls",
            "--data-dir",
            data.to_str().unwrap(),
            "--client-ca-file",
            missing.to_str().unwrap(),
            "--ateapi-cert-file",
            "/etc/hosts",
            "--ateapi-key-file",
            "/etc/hosts",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(64));
    let lines = stderr_lines(&o);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(lines[0].contains("--client-ca-file"), "{lines:?}");
    assert!(!data.exists(), "nothing written");
}

/// A value starting with `-` is refused by its flag's own rule, which names the flag.
#[test]
fn a_negative_value_names_its_flag() {
    for (flag, value) in [("--parked-request-max", "-1"), ("--drain-delay", "-1s")] {
        let o = valet(&["router", "--check", flag, value], &[]);
        assert_eq!(o.status.code(), Some(64), "{flag}");
        let lines = stderr_lines(&o);
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(
            lines[0].contains(flag) && lines[0].contains(value),
            "{lines:?}"
        );
    }
}

/// `--help` never prints a database URL's password taken from the environment.
#[test]
fn help_hides_database_urls_from_the_environment() {
    let url = "postgres://u:s3cret@db.example/valet";
    for (args, var) in [
        (&["control-plane", "--help"][..], "VALET_DATABASE"),
        (&["load", "scenario", "--help"][..], "VALET_TARGET_DATABASE"),
    ] {
        let o = valet(args, &[(var, url)]);
        assert!(o.status.success(), "{args:?}");
        let help = String::from_utf8_lossy(&o.stdout);
        assert!(help.contains(var), "{args:?}: {help}");
        assert!(!help.contains("s3cret"), "{args:?}: {help}");
    }
}

/// The PostgreSQL store connects without TLS: a URL that requires TLS is refused at
/// start (exit 64, one line), not found out as an unreachable database (exit 1).
#[test]
fn a_database_url_requiring_tls_is_refused() {
    let o = valet(
        &[
            "control-plane",
            "--database",
            "postgres://valet@127.0.0.1:1/valet?sslmode=require",
        ],
        &[],
    );
    assert_eq!(o.status.code(), Some(64));
    let lines = stderr_lines(&o);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("--database: sslmode=require"),
        "{lines:?}"
    );
}

/// valet raises its soft open-file limit to the hard one at start, as Go programs (the
/// seed's router among them) do: the data planes size their connection caps by it.
#[test]
fn the_soft_open_file_limit_is_raised_to_the_hard_one() {
    use std::io::BufRead as _;
    let script = format!(
        "ulimit -Sn 256 && exec '{}' router --control-plane http://127.0.0.1:9 \
         --listen 127.0.0.1:0 --extproc-listen '' --admin-listen ''",
        env!("CARGO_BIN_EXE_valet")
    );
    let mut child = Command::new("sh")
        .args(["-c", &script])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let listening = lines.next().unwrap().unwrap();
    assert!(listening.starts_with("listening router"), "{listening}");
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", child.id())).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let open_files: Vec<&str> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .split_whitespace()
        .collect();
    // "Max open files <soft> <hard> files"
    assert_eq!(open_files[3], open_files[4], "{limits}");
    assert_ne!(open_files[3], "256", "{limits}");
}
