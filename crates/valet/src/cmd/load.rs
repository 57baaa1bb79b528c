//! `valet load` and `valet demo parking`.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use valet_load::generate::{HttpClient, closed_loop_until, open_loop_until, schedule};
use valet_load::processes::ProcessesOpts;
use valet_load::record::write_csv_file;
use valet_load::scenario::{self, Report};
use valet_load::system::{System, SystemOpts};
use valet_load::{Summary, chart};

use clap::ValueEnum as _;

use crate::EXIT_CONFIG;
use crate::cli::{
    CapacityWait, DemoArgs, LoadCommand, LoadRunArgs, Scenario, ScenarioArgs, TargetArgs,
};

/// Runs `work` until it ends or SIGTERM/SIGINT arrives; then it is dropped, and with
/// it every part it started (the processes of --processes are killed and its throwaway
/// database stopped).
async fn until_terminated<F>(work: F) -> Result<(), Failure>
where
    F: std::future::Future<Output = Result<(), Failure>>,
{
    let terminated = crate::signal::terminated_without_force();
    tokio::select! {
        r = work => r,
        () = terminated => Err(Failure::Run("interrupted; every part it started is stopped".into())),
    }
}

pub(crate) async fn run(cmd: LoadCommand) -> ExitCode {
    let result = match cmd {
        // A run keeps what it measured when interrupted (it stops by itself).
        LoadCommand::Run(args) => load_run(args).await,
        LoadCommand::Scenario(args) => until_terminated(run_scenario(args)).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(e)) => {
            say_usage!("valet load: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(Failure::Run(e)) => {
            say_err!("valet load: {e}");
            ExitCode::FAILURE
        }
    }
}

enum Failure {
    Usage(String),
    Run(String),
}

impl From<String> for Failure {
    fn from(s: String) -> Self {
        Failure::Run(s)
    }
}

/// The most requests an open-loop run schedules (each is recorded in memory).
const MAX_SCHEDULED: f64 = 10_000_000.0;

async fn load_run(args: LoadRunArgs) -> Result<(), Failure> {
    if args.actors.is_empty() {
        return Err(Failure::Usage(
            "invalid configuration: --actors: name at least one actor".into(),
        ));
    }
    if args.duration.is_zero() {
        return Err(Failure::Usage(
            "invalid configuration: --duration=0s: must be > 0".into(),
        ));
    }
    if !args.path.starts_with('/') || args.path.bytes().any(|b| b.is_ascii_whitespace()) {
        return Err(Failure::Usage(format!(
            "invalid configuration: --path={}: must start with / and hold no spaces",
            args.path
        )));
    }
    let client = HttpClient::new(&args.actor_domain);
    let (router, path) = (args.router, args.path.clone());
    let send = move |actor: String| {
        let (client, path) = (client.clone(), path.clone());
        async move { client.get(router, &actor, &path).await }
    };
    // SIGTERM or SIGINT ends the run early: nothing more is sent, what was answered
    // is summed up and written, and the exit says the run was cut short.
    let stop = tokio_util::sync::CancellationToken::new();
    let interrupted = {
        let stop = stop.clone();
        async move {
            crate::signal::terminated_without_force().await;
            stop.cancel();
            std::future::pending::<()>().await;
        }
    };
    let started = tokio::time::Instant::now();
    let run = async {
        match (args.rate, args.concurrency) {
            (Some(rate), _)
                if rate > 0.0 && rate * args.duration.as_secs_f64() <= MAX_SCHEDULED =>
            {
                let at = schedule(rate, args.duration);
                Ok(open_loop_until("load", &at, &args.actors, send, &stop).await)
            }
            (Some(rate), _) if rate > 0.0 && rate.is_finite() => Err(Failure::Usage(format!(
                "invalid configuration: --rate={rate} with --duration={:?}: at most {MAX_SCHEDULED} requests in one run",
                args.duration
            ))),
            (Some(rate), _) => Err(Failure::Usage(format!(
                "invalid configuration: --rate={rate}: must be a finite number > 0"
            ))),
            (None, Some(0)) => Err(Failure::Usage(
                "invalid configuration: --concurrency=0: must be >= 1".into(),
            )),
            (None, c) => Ok(closed_loop_until(
                "load",
                c.unwrap_or(1),
                args.duration,
                &args.actors,
                send,
                &stop,
            )
            .await),
        }
    };
    let records = tokio::select! {
        r = run => r?,
        () = interrupted => unreachable!("pending after the signal"),
    };
    let summary = Summary::of(&records);
    say!("{summary}");
    say_raw!("{}", summary.seed_block());
    if let Some(path) = &args.csv {
        write_csv_file(path, &records)?;
        say!("wrote {}", path.display());
    }
    if let Some(path) = &args.svg {
        chart::latency_chart(path, "valet load", &records, None)?;
        say!("wrote {}", path.display());
    }
    if stop.is_cancelled() {
        return Err(Failure::Run(format!(
            "interrupted after {:.1}s of {:?}: the results above are of the requests answered until then",
            started.elapsed().as_secs_f64(),
            args.duration
        )));
    }
    // A router that never answered (the wrong address, say) is no measurement.
    if summary.total > 0 && summary.answered.is_none() {
        return Err(Failure::Run(format!(
            "none of the {} requests got an HTTP answer from --router={} (see the errors above)",
            summary.total, args.router
        )));
    }
    Ok(())
}

/// Writes a report's CSV and chart into `out` and prints it.
fn publish(report: &Report, tag: &str, out: &Path) -> Result<(), String> {
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    let stem = format!("{}{tag}", report.name);
    let csv = out.join(format!("{stem}.csv"));
    let svg = out.join(format!("{stem}.svg"));
    write_csv_file(&csv, &report.records)?;
    chart::latency_chart(
        &svg,
        &format!("valet: {stem}"),
        &report.records,
        report.budget_s,
    )?;
    say!("== {stem}");
    say_raw!("{}", report.text);
    say!(
        "   (records: {}, chart: {})\n",
        csv.display(),
        svg.display()
    );
    Ok(())
}

fn opts(target: &TargetArgs, workers: usize, capacity_wait: bool, extra: &[&str]) -> SystemOpts {
    let mut router_flags = vec![
        "--parked-request-budget".to_owned(),
        valet_router::config::fmt_duration(target.budget),
    ];
    router_flags.extend(extra.iter().map(|s| (*s).to_owned()));
    SystemOpts {
        workers,
        restore_delay: target.restore_delay,
        capacity_wait,
        router_flags,
        router_exe: None,
        app: target.app.as_deref().map(|line| {
            valet_template::Program::from_command_line(line, std::env::current_dir().ok())
                .expect("checked by target_app")
        }),
        ..SystemOpts::default()
    }
}

/// `--app` checked: a command line, runnable here.
fn check_app(target: &TargetArgs) -> Result<(), String> {
    let Some(line) = &target.app else {
        return Ok(());
    };
    let program = valet_template::Program::from_command_line(line, std::env::current_dir().ok())
        .map_err(|e| format!("invalid configuration: --app={line:?}: {e}"))?;
    program
        .check_runnable()
        .map_err(|e| format!("invalid configuration: --app: {e}"))
}

async fn system(target: &TargetArgs, opts: &SystemOpts) -> Result<System, String> {
    if target.processes {
        let processes = ProcessesOpts {
            exe: std::env::current_exe().map_err(|e| format!("this valet binary: {e}"))?,
            database: target.database.clone(),
            replicas: 2,
            routers: 2,
            workers: opts.workers,
            restore_delay: opts.restore_delay,
            capacity_wait: opts.capacity_wait,
            router_flags: opts.router_flags.clone(),
        };
        let sys = System::start_processes(&processes).await?;
        if let Some(p) = sys.processes() {
            say!(
                "processes: {} workers; replicas {} (all active) on {}; routers {}\n",
                opts.workers,
                p.replicas.join(" "),
                p.database,
                p.routers
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(" "),
            );
        }
        return Ok(sys);
    }
    match (&target.router, &target.control_plane) {
        (Some(r), Some(cp)) => System::remote(*r, cp),
        _ => System::embedded(opts).await,
    }
}

/// Stops `sys` after a scenario; on processes, the report says how many requests
/// each router counted.
async fn finish(sys: System, report: Result<Report, String>) -> Result<Report, String> {
    let counted = sys.requests_per_router().await;
    sys.shutdown().await;
    let mut report = report?;
    if counted.len() > 1 {
        let each: Vec<String> = counted.iter().map(|(r, n)| format!("{r}: {n}")).collect();
        report.text.push_str(&format!(
            "requests each router counted (atenet_router_requests_total): {}\n",
            each.join(", ")
        ));
    }
    Ok(report)
}

/// Checks the target flags against the scenario: which run on processes, and the
/// database URL.
fn check_target(target: &TargetArgs, scenario: Option<Scenario>) -> Result<(), Failure> {
    check_app(target).map_err(Failure::Usage)?;
    if !target.processes {
        return Ok(());
    }
    if let Some(s) = scenario
        && !matches!(
            s,
            Scenario::Timeline | Scenario::Steady | Scenario::Bursts | Scenario::Overflow
        )
    {
        let name = clap::ValueEnum::to_possible_value(&s)
            .map(|v| v.get_name().to_owned())
            .unwrap_or_default();
        return Err(Failure::Usage(format!(
            "invalid configuration: --processes: runs timeline, steady, bursts and overflow, not {name}"
        )));
    }
    if let Some(url) = &target.database
        && !(url.starts_with("postgres://") || url.starts_with("postgresql://"))
    {
        return Err(Failure::Usage(
            "invalid configuration: --database: must be a postgres:// URL".into(),
        ));
    }
    Ok(())
}

async fn run_scenario(args: ScenarioArgs) -> Result<(), Failure> {
    check_target(&args.target, Some(args.scenario))?;
    let remote = args.target.router.is_some();
    let modes: Vec<bool> = match (remote, args.capacity_wait) {
        (true, _) | (false, CapacityWait::On) => vec![true],
        (false, CapacityWait::Off) => vec![false],
        (false, CapacityWait::Both) => vec![true, false],
    };
    let t = &args.target;
    let processes = if t.processes { "-processes" } else { "" };
    // A mode whose run fails its check does not keep the other from running.
    let mut failures = Vec::new();
    let both = modes.len() > 1;
    for cw in modes {
        let tag = if remote {
            String::new()
        } else if cw {
            format!("{processes}-capacity-wait-on")
        } else {
            format!("{processes}-capacity-wait-off")
        };
        let name = args
            .scenario
            .to_possible_value()
            .map_or_else(String::new, |v| v.get_name().to_owned());
        let what = format!("valet load scenario {name}{tag}");
        let report = with_progress(&what, async {
            Ok::<_, Failure>(match args.scenario {
            Scenario::Timeline => {
                let sys = system(t, &opts(t, 2, cw, &[])).await?;
                let r = scenario::timeline(&sys, t.budget, 9, Duration::from_millis(2370)).await;
                finish(sys, r).await?
            }
            Scenario::Steady => {
                let sys = system(t, &opts(t, 2, cw, &[])).await?;
                let r =
                    scenario::steady(&sys, args.duration.unwrap_or(Duration::from_secs(30))).await;
                finish(sys, r).await?
            }
            Scenario::Bursts => {
                let sys = system(t, &opts(t, 16, cw, &[])).await?;
                let r = scenario::bursts(&sys, &[1, 2, 4, 8, 16], 5).await;
                finish(sys, r).await?
            }
            Scenario::Overflow => {
                let sys = system(t, &opts(t, 16, cw, &[])).await?;
                let r = scenario::overflow(&sys, t.budget, Duration::from_millis(1500)).await;
                finish(sys, r).await?
            }
            Scenario::ParkedScale => {
                let lot = args.requests.to_string();
                let mut o = opts(t, 1, cw, &["--parked-request-max", &lot]);
                o.router_exe = std::env::current_exe().ok();
                // The ext_proc figure is for a running actor under a route lease (no
                // control-plane call).
                o.route_lease = Duration::from_secs(5);
                let sys = system(t, &o).await?;
                let po = valet_load::parked::ParkedScaleOpts {
                    requests: args.requests,
                    actors: args.parked_actors,
                    body: usize::try_from(args.body).unwrap_or(usize::MAX),
                    budget: t.budget,
                    extproc_requests: args.extproc_requests,
                };
                let r = valet_load::parked::parked_scale(&sys, &po).await;
                finish(sys, r).await?
            }
            Scenario::Soak => {
                if remote {
                    return Err(Failure::Usage(
                        "invalid configuration: soak reads the router's books; run it on embedded parts (no --router)".into(),
                    ));
                }
                let mut o = opts(t, args.workers, cw, &[]);
                o.evict_idle_after = args.evict_idle_after.unwrap_or_default();
                let sys = system(t, &o).await?;
                let soak_opts = valet_load::soak::SoakOpts {
                    duration: args.duration.unwrap_or(Duration::from_secs(600)),
                    budget: t.budget,
                    actors: args.actors,
                    ..Default::default()
                };
                let r = valet_load::soak::soak(&sys, &soak_opts).await;
                finish(sys, r).await?
            }
            Scenario::Eviction => {
                if remote {
                    return Err(Failure::Usage(
                        "invalid configuration: eviction configures the embedded control plane; run it without --router".into(),
                    ));
                }
                let evict_after = args.evict_idle_after.unwrap_or(Duration::from_secs(10));
                let mut o = opts(t, args.runs, cw, &[]);
                o.evict_idle_after = evict_after;
                let sys = system(t, &o).await?;
                let r = scenario::eviction(&sys, args.runs, args.runs, evict_after).await;
                finish(sys, r).await?
            }
            Scenario::Leases => {
                if remote {
                    return Err(Failure::Usage(
                        "invalid configuration: leases runs its own control plane; run it without --router".into(),
                    ));
                }
                let exe = std::env::current_exe().map_err(|e| e.to_string())?;
                valet_load::outage::leases(&valet_load::outage::LeaseOpts {
                    exe,
                    lease: args.route_lease.unwrap_or(Duration::from_secs(5)),
                    cycles: args.runs,
                    outage: args.duration.unwrap_or(Duration::from_secs(10)),
                    clients: 8,
                    capacity_wait: cw,
                    budget: t.budget,
                })
                .await?
            }
            Scenario::FastPath => {
                let mut o = opts(t, 0, cw, &[]);
                o.echo_workers = 1;
                o.route_lease = args.route_lease.unwrap_or(Duration::from_secs(5));
                let sys = system(t, &o).await?;
                let r =
                    scenario::fast_path(&sys, 32, args.duration.unwrap_or(Duration::from_secs(10)))
                        .await;
                finish(sys, r).await?
            }
            })
        })
        .await?;
        publish(&report, &tag, &args.out)?;
        // Published first: the records explain the failure.
        if let Some(why) = report.failed {
            failures.push(match (both, cw) {
                (false, _) => why,
                (true, true) => format!("--capacity-wait on: {why}"),
                (true, false) => format!("--capacity-wait off: {why}"),
            });
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(Failure::Run(failures.join("; ")))
    }
}

/// How often a scenario says it is still running.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Runs `work`, with a line on stderr every [`PROGRESS_EVERY`] while it runs: a
/// scenario prints its report only once it ends.
async fn with_progress<T>(what: &str, work: impl std::future::Future<Output = T>) -> T {
    let start = tokio::time::Instant::now();
    let mut tick = tokio::time::interval_at(start + PROGRESS_EVERY, PROGRESS_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut work = std::pin::pin!(work);
    loop {
        tokio::select! {
            r = &mut work => return r,
            _ = tick.tick() => say_err!("{what}: running for {:.0}s", start.elapsed().as_secs_f64()),
        }
    }
}

pub(crate) async fn demo_parking(args: DemoArgs) -> ExitCode {
    if let Err(Failure::Usage(e) | Failure::Run(e)) = check_target(&args.target, None) {
        say_usage!("valet demo parking: {e}");
        return ExitCode::from(EXIT_CONFIG);
    }
    let result = until_terminated(with_progress("valet demo parking", async {
        let t = &args.target;
        let tag = if t.processes { "-processes" } else { "" };
        say!(
            "valet demo parking: pool of 2 workers (restore {:?}), actors p1..p4, budget {:?}\n",
            t.restore_delay,
            t.budget
        );
        let sys = system(t, &opts(t, 2, true, &[])).await?;
        let timeline = scenario::timeline(&sys, t.budget, 3, Duration::from_millis(2370)).await?;
        publish(&timeline, tag, &args.out)?;
        say!(
            "load run: 4 actors on 2 workers for {:?}, each answer followed by a suspend\n",
            args.duration
        );
        let steady = scenario::steady(&sys, args.duration).await?;
        publish(&steady, tag, &args.out)?;
        sys.shutdown().await;
        Ok(())
    }))
    .await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(e) | Failure::Run(e)) => {
            say_err!("valet demo parking: {e}");
            ExitCode::FAILURE
        }
    }
}
