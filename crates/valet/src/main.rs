//! `valet`: the request-parking router, its reference control plane and workers, in
//! one binary. See `../shared/spec/cli.md` for the command-line contract.

#![forbid(unsafe_code)]

/// `println!` for the lines a long-running command prints (`listening …`), which never
/// panics when stdout is closed: a reader that took the lines it wanted and left does
/// not end the process.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

/// `print!` that never panics (see `say!`).
macro_rules! say_raw {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = write!(std::io::stdout(), $($arg)*);
    }};
}

/// `eprintln!` that never panics: with stderr a closed pipe (`valet up 2>&1 | tee`,
/// tee gone with the first Ctrl-C), a panic would end the task that was to exit.
macro_rules! say_err {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// Writes an invalid configuration's message to stderr on one line: control
/// characters in it (a value read from a file ends in a newline) are escaped.
macro_rules! say_usage {
    ($($arg:tt)*) => {{
        say_err!("{}", valet_router::config::one_line(&format!($($arg)*)));
    }};
}

mod admin;
mod cli;
mod cmd;
mod serve;
mod signal;

use std::process::ExitCode;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};

use cli::{Cli, Command};

/// mimalloc instead of the system allocator: the data planes allocate and free small
/// objects on every request from both runtime threads, where glibc's malloc spends a
/// tenth of the router's CPU (measured in docs/BENCHMARKS.md).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Exit status of an invalid configuration (`EX_USAGE`).
const EXIT_CONFIG: u8 = 64;

/// The command line. `valet up` takes the router's flags and the control plane's, with
/// differences its `--help` shows: its listeners default to loopback, it has no
/// `--control-plane` (its router uses the embedded control plane; `VALET_CONTROL_PLANE`,
/// there for `valet router` and `valet ctl`, is not read), and it suspends idle actors,
/// evicts for waiters and serves its control plane's metrics by default.
fn command() -> clap::Command {
    no_default_shown(hyphen_values(Cli::command())).mut_subcommand("up", |up| {
        up.mut_arg("listen", |a| a.default_value("127.0.0.1:8080"))
            .mut_arg("extproc_listen", |a| a.default_value("127.0.0.1:50051"))
            .mut_arg("control_plane", |a| a.hide(true).env(None::<&'static str>))
            .mut_arg("idle_suspend_after", |a| {
                a.default_value(cli::DEFAULT_UP_IDLE_SUSPEND_AFTER)
            })
            .mut_arg("evict_idle_after", |a| {
                a.default_value(cli::DEFAULT_UP_EVICT_IDLE_AFTER)
            })
            .mut_arg("metrics_listen", |a| {
                a.default_value(cli::DEFAULT_UP_METRICS_LISTEN)
            })
    })
}

/// A value starting with `-` after a flag that takes one value is that flag's value
/// (`--parked-request-max -1`, `--drain-delay -1s`): refused by the flag's own rule,
/// which names it, instead of clap's "unexpected argument '-1'".
fn hyphen_values(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| {
        let one = a
            .get_num_args()
            .is_none_or(|n| n.min_values() == 1 && n.max_values() == 1);
        if !a.is_positional() && a.get_action().takes_values() && one {
            a.allow_hyphen_values(true)
        } else {
            a
        }
    })
    .mut_subcommands(hyphen_values)
}

/// `--help` gives every flag's default (spec/cli.md): a flag that takes a value, is
/// not required, has no default value and whose help names none (`Default: …`) says
/// `[default: none]` (it is off until given).
fn no_default_shown(cmd: clap::Command) -> clap::Command {
    cmd.mut_args(|a| {
        let help = a.get_long_help().or(a.get_help()).map(ToString::to_string);
        if a.is_positional()
            || !a.get_action().takes_values()
            || a.is_required_set()
            || !a.get_default_values().is_empty()
            || help
                .as_deref()
                .is_some_and(|h| h.to_lowercase().contains("default:"))
        {
            return a;
        }
        let short = a.get_help().map(|h| format!("{h} [default: none]"));
        let long = help.map_or_else(
            || "[default: none]".to_owned(),
            |h| format!("{h}\n\n[default: none]"),
        );
        a.help(short.unwrap_or_else(|| "[default: none]".to_owned()))
            .long_help(long)
    })
    .mut_subcommands(no_default_shown)
}

/// Raises the soft open-file limit to the hard one, as every Go program does at start
/// (the seed's router among them): a router holds a descriptor for each client
/// connection and each worker connection, a soft limit of 1024 is common, and the
/// data planes size their connection caps by it (`Limits::max_connections`).
fn raise_open_file_limit() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if let (Some(current), Some(maximum)) = (limit.current, limit.maximum)
        && current < maximum
    {
        let raised = Rlimit {
            current: Some(maximum),
            maximum: Some(maximum),
        };
        // Refused (a sandbox, say): the soft limit stays, and so do the caps sized by it.
        let _ = setrlimit(Resource::Nofile, raised);
    }
}

fn main() -> ExitCode {
    raise_open_file_limit();
    let matches = match command().try_get_matches() {
        Ok(m) => m,
        Err(e) => return cli::parse_error_exit(&e),
    };
    let mut cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => return cli::parse_error_exit(&e),
    };
    if let Some(m) = matches.subcommand_matches("up")
        && m.value_source("control_plane") == Some(ValueSource::CommandLine)
    {
        let given = m
            .get_raw("control_plane")
            .into_iter()
            .flatten()
            .map(|v| v.to_string_lossy())
            .collect::<Vec<_>>()
            .join(",");
        say_usage!(
            "valet up: invalid configuration: --control-plane={given}: valet up runs its own control plane (see --control-plane-listen)"
        );
        return ExitCode::from(EXIT_CONFIG);
    }
    // With --database, route leases default to off (they are not shared across
    // replicas yet); one given explicitly is checked by the command.
    if let (Command::ControlPlane(cp), Some(m)) = (
        &mut cli.command,
        matches.subcommand_matches("control-plane"),
    ) && cp.database.is_some()
        && m.value_source("route_lease") == Some(ValueSource::DefaultValue)
    {
        cp.plane.leases.route_lease = std::time::Duration::ZERO;
    }
    // `--processes` was `--cluster`, read from VALET_TARGET_CLUSTER: still honoured.
    let target = match &mut cli.command {
        Command::Load(cli::LoadCommand::Scenario(s)) => Some(&mut s.target),
        Command::Demo(cli::DemoCommand::Parking(d)) => Some(&mut d.target),
        _ => None,
    };
    if let Some(target) = target
        && !target.processes
        && std::env::var("VALET_TARGET_CLUSTER").is_ok_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        })
    {
        if target.router.is_some() {
            say_usage!(
                "valet: invalid configuration: VALET_TARGET_CLUSTER (now VALET_TARGET_PROCESSES) cannot be used with --router"
            );
            return ExitCode::from(EXIT_CONFIG);
        }
        target.processes = true;
    }
    if let (Command::Up(up), Some(m)) = (&mut cli.command, matches.subcommand_matches("up")) {
        up.listen_https_given = m.value_source("listen_https") != Some(ValueSource::DefaultValue);
    }
    // Load runs and demos embed every part: keep their output to results and warnings.
    let quiet = matches!(cli.command, Command::Load(_) | Command::Demo(_));
    init_tracing(
        cli.log_format,
        cli.log_level.as_deref(),
        if quiet { "warn" } else { "info" },
    );
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            say_err!("valet: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        match cli.command {
            Command::Router(args) => cmd::router::run(args).await,
            Command::ControlPlane(args) => cmd::control_plane::run(args).await,
            Command::Worker(args) => cmd::worker::run(args).await,
            Command::Ctl(args) => cmd::ctl::run(args).await,
            Command::Up(args) => cmd::up::run(*args).await,
            Command::EnvoyBootstrap(args) => cmd::envoy_bootstrap::run(&args),
            Command::Load(cmd) => cmd::load::run(cmd).await,
            Command::Demo(cli::DemoCommand::Parking(args)) => cmd::load::demo_parking(args).await,
        }
    })
}

/// Logs to stderr: `--log-level` (else VALET_LOG, else `default`) in `--log-format`
/// (else text on a terminal, json otherwise).
fn init_tracing(format: Option<cli::LogFormat>, level: Option<&str>, default: &str) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    // `--log-level` was checked by its parser; VALET_LOG falls back to the default.
    let filter = match level {
        Some(l) => EnvFilter::new(l),
        None => EnvFilter::try_from_env("VALET_LOG").unwrap_or_else(|_| EnvFilter::new(default)),
    };
    let terminal = std::io::stderr().is_terminal();
    let format = format.unwrap_or(if terminal {
        cli::LogFormat::Text
    } else {
        cli::LogFormat::Json
    });
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        cli::LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
        cli::LogFormat::Text => builder.with_target(false).with_ansi(terminal).init(),
    }
}
