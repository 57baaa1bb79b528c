//! Actor templates: what a worker runs for the actors of a template, and what a
//! suspend keeps of them.
//!
//! ```text
//! templates.toml ──▶ Templates::load ──▶ control plane: pool, snapshot kind
//!                                   └──▶ worker: the program to run (or a built-in app)
//! ```
//!
//! A template is either one of the worker's built-in apps (`counter`, `echo`) or a
//! **program**: any command that serves HTTP on the port it is given in `PORT` and keeps
//! its state in the directory it is given in `VALET_DATA_DIR`. A template's pool has
//! the template's name. The file format:
//!
//! ```toml
//! [templates.notes]
//! command = "python3 app.py"      # or ["python3", "app.py"]; {port} and {data} are substituted
//! dir = "."                       # working directory, relative to this file
//! env = { NOTES_TITLE = "notes" }
//! ready = "/healthz"              # HTTP path (default: any answer below 500 on /), or "tcp"
//! start_timeout = "30s"
//! stop_signal = "SIGTERM"
//! stop_grace = "10s"
//! protocol = "http1"              # or "h2c"
//! snapshot = "data"               # programs keep their data directory only
//! [templates.notes.limits]
//! memory = "256MiB"               # address space (RLIMIT_AS), and memory.max with --cgroup
//! cpu = 0.5                       # CPUs (cgroup v2 cpu.max; needs --cgroup)
//! cpu_time = "60m"                # RLIMIT_CPU
//! open_files = 1024               # RLIMIT_NOFILE
//!
//! [templates.counter]
//! app = "counter"
//! snapshot = "full"
//! ```

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;
use valet_proto::units::{parse_bytes, parse_duration};

/// The rule every template (and so pool) name follows: a DNS label, so actors stay
/// addressable by host.
pub const LABEL_RULE: &str =
    "must be 1-63 characters of a-z, 0-9 and '-', not starting or ending with '-'";

/// Whether `value` is a DNS label ([`LABEL_RULE`]).
pub fn is_label(value: &str) -> bool {
    !value.is_empty()
        && value.len() <= 63
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !value.starts_with('-')
        && !value.ends_with('-')
}

/// Default `start_timeout`: how long a program may take to answer its readiness probe.
pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(30);
/// Default `stop_grace`: how long a program has to exit after its stop signal before
/// its process group is killed.
pub const DEFAULT_STOP_GRACE: Duration = Duration::from_secs(10);
/// The longest `start_timeout` or `stop_grace` accepted.
pub const MAX_PROGRAM_WAIT: Duration = Duration::from_secs(3600);
/// Largest templates file read.
pub const MAX_FILE_BYTES: u64 = 1 << 20;
/// Environment variables the worker sets for every program; a template cannot.
pub const RESERVED_ENV: &[&str] = &["PORT", "VALET_DATA_DIR", "VALET_ACTOR", "VALET_RUN_ID"];

/// The built-in apps of the reference worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Builtin {
    /// The seed's demo: counts requests in memory and in a file.
    Counter,
    /// Streams bodies back and echoes WebSocket messages.
    Echo,
}

impl Builtin {
    /// Its name on the wire and in files.
    pub fn name(self) -> &'static str {
        match self {
            Builtin::Counter => "counter",
            Builtin::Echo => "echo",
        }
    }

    /// Every built-in app's name.
    pub const NAMES: &'static [&'static str] = &["counter", "echo"];
}

impl FromStr for Builtin {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "counter" => Ok(Builtin::Counter),
            "echo" => Ok(Builtin::Echo),
            other => Err(format!(
                "app {other:?} must be one of {}",
                Builtin::NAMES.join(", ")
            )),
        }
    }
}

/// How a program's readiness is checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// An HTTP `GET` of `path`: ready once it answers 2xx or 3xx, or, for the default
    /// probe (`explicit` false, path `/`), any status below 500.
    Http { path: String, explicit: bool },
    /// A TCP connect to its port.
    Tcp,
}

impl Probe {
    /// Whether an HTTP answer with `status` means ready.
    pub fn ready_with(&self, status: u16) -> bool {
        match self {
            Probe::Http { explicit: true, .. } => (200..400).contains(&status),
            Probe::Http {
                explicit: false, ..
            } => status < 500,
            Probe::Tcp => true,
        }
    }
}

impl fmt::Display for Probe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Probe::Http { path, .. } => write!(f, "HTTP GET {path}"),
            Probe::Tcp => f.write_str("TCP connect"),
        }
    }
}

/// The protocol a program serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// HTTP/1.1 (upgrades such as WebSocket included).
    Http1,
    /// HTTP/2 without TLS, with prior knowledge (gRPC servers).
    H2c,
}

/// The signal a program is stopped with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopSignal {
    Term,
    Int,
    Quit,
    Hup,
    Usr1,
    Usr2,
}

impl StopSignal {
    /// `SIGTERM`, ...
    pub fn name(self) -> &'static str {
        match self {
            StopSignal::Term => "SIGTERM",
            StopSignal::Int => "SIGINT",
            StopSignal::Quit => "SIGQUIT",
            StopSignal::Hup => "SIGHUP",
            StopSignal::Usr1 => "SIGUSR1",
            StopSignal::Usr2 => "SIGUSR2",
        }
    }
}

impl FromStr for StopSignal {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let name = s.trim().to_ascii_uppercase();
        let name = name.strip_prefix("SIG").unwrap_or(&name);
        Ok(match name {
            "TERM" => StopSignal::Term,
            "INT" => StopSignal::Int,
            "QUIT" => StopSignal::Quit,
            "HUP" => StopSignal::Hup,
            "USR1" => StopSignal::Usr1,
            "USR2" => StopSignal::Usr2,
            _ => {
                return Err(format!(
                    "{s:?} is not a stop signal (want SIGTERM, SIGINT, SIGQUIT, SIGHUP, SIGUSR1 or SIGUSR2; SIGKILL comes by itself after stop_grace)"
                ));
            }
        })
    }
}

/// A program's resource limits.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Limits {
    /// Bytes of address space (`RLIMIT_AS`), and `memory.max` where the worker has a
    /// cgroup.
    pub memory: Option<u64>,
    /// CPUs (`cpu.max`); only where the worker has a cgroup with the cpu controller.
    pub cpu: Option<f64>,
    /// CPU time (`RLIMIT_CPU`, whole seconds, rounded up).
    pub cpu_time: Option<Duration>,
    /// Open files (`RLIMIT_NOFILE`).
    pub open_files: Option<u64>,
}

impl Limits {
    /// Whether any limit is set.
    pub fn any(&self) -> bool {
        self.memory.is_some()
            || self.cpu.is_some()
            || self.cpu_time.is_some()
            || self.open_files.is_some()
    }
}

/// A program that runs as an actor.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    /// The program and its arguments; `{port}` and `{data}` in them are substituted.
    pub command: Vec<String>,
    /// Its working directory (absolute once loaded from a file); the worker's own when
    /// `None`.
    pub dir: Option<PathBuf>,
    /// Environment besides what the worker sets (see [`RESERVED_ENV`]).
    pub env: BTreeMap<String, String>,
    pub ready: Probe,
    pub start_timeout: Duration,
    pub stop_signal: StopSignal,
    pub stop_grace: Duration,
    pub protocol: Protocol,
    pub limits: Limits,
}

impl Program {
    /// A program from one command line (`valet up --app 'python3 app.py'`): split as a
    /// shell would (quotes, backslashes; no expansions), run in `dir`, with every other
    /// setting at its default.
    ///
    /// # Errors
    /// An empty command or unbalanced quotes.
    pub fn from_command_line(line: &str, dir: Option<PathBuf>) -> Result<Self, String> {
        Ok(Self {
            command: split_command(line)?,
            dir,
            env: BTreeMap::new(),
            ready: Probe::Http {
                path: "/".into(),
                explicit: false,
            },
            start_timeout: DEFAULT_START_TIMEOUT,
            stop_signal: StopSignal::Term,
            stop_grace: DEFAULT_STOP_GRACE,
            protocol: Protocol::Http1,
            limits: Limits::default(),
        })
    }

    /// Its arguments with `{port}` and `{data}` substituted (the program first).
    pub fn argv(&self, port: u16, data: &Path) -> Vec<String> {
        let data = data.to_string_lossy();
        self.command
            .iter()
            .map(|a| {
                a.replace("{port}", &port.to_string())
                    .replace("{data}", &data)
            })
            .collect()
    }

    /// The file the worker executes: the command's first word, as a path (relative to
    /// [`Program::dir`]) when it holds a `/`, else found on `PATH`.
    ///
    /// # Errors
    /// When it cannot be found, is not a file, or is not executable, saying which.
    pub fn executable(&self) -> Result<PathBuf, String> {
        let first = self.command.first().map(String::as_str).unwrap_or_default();
        if first.contains('/') {
            let path = match &self.dir {
                Some(dir) if Path::new(first).is_relative() => dir.join(first),
                _ => PathBuf::from(first),
            };
            return check_executable(&path).map(|()| path);
        }
        let paths = std::env::var_os("PATH").unwrap_or_default();
        for dir in std::env::split_paths(&paths) {
            let candidate = dir.join(first);
            if check_executable(&candidate).is_ok() {
                return Ok(candidate);
            }
        }
        Err(format!("command {first:?} is not found on PATH"))
    }

    /// Whether the worker can run it: its command is an executable file and its
    /// working directory a directory.
    ///
    /// # Errors
    /// What is missing, naming it.
    pub fn check_runnable(&self) -> Result<(), String> {
        if let Some(dir) = &self.dir
            && !dir.is_dir()
        {
            return Err(format!("dir {} is not a directory", dir.display()));
        }
        self.executable().map(drop)
    }
}

fn check_executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt as _;
    let meta = std::fs::metadata(path)
        .map_err(|e| format!("command {} cannot be used: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("command {} is not a file", path.display()));
    }
    if meta.permissions().mode() & 0o111 == 0 {
        return Err(format!("command {} is not executable", path.display()));
    }
    Ok(())
}

/// Splits a command line as a shell would (quotes, backslashes; no expansions).
fn split_command(line: &str) -> Result<Vec<String>, String> {
    let words = shlex::split(line)
        .ok_or_else(|| format!("command {line:?} has unbalanced quotes or a trailing backslash"))?;
    if words.is_empty() || words[0].is_empty() {
        return Err("command is empty".into());
    }
    Ok(words)
}

/// What a template runs.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    /// A built-in app; `full` snapshots keep its memory too.
    Builtin { app: Builtin, full: bool },
    /// A program, which keeps its data directory only.
    Program(Box<Program>),
}

/// An actor template: its name (which is also its pool's), and what it runs.
#[derive(Debug, Clone, PartialEq)]
pub struct Template {
    name: String,
    kind: Kind,
}

impl Template {
    /// A template running `kind`.
    ///
    /// # Errors
    /// A name that is not a DNS label.
    pub fn new(name: &str, kind: Kind) -> Result<Self, String> {
        if !is_label(name) {
            return Err(format!("template {name:?} {LABEL_RULE}"));
        }
        Ok(Self {
            name: name.to_owned(),
            kind,
        })
    }

    /// The demo app's template: pool `counter`, data snapshots (the upstream demo's
    /// default: a suspend keeps the file counter, not the memory count).
    pub fn counter() -> Self {
        Self {
            name: "counter".into(),
            kind: Kind::Builtin {
                app: Builtin::Counter,
                full: false,
            },
        }
    }

    /// A template whose app streams request bodies back and echoes WebSocket messages
    /// (pool `echo`), for data-plane tests.
    pub fn echo() -> Self {
        Self {
            name: "echo".into(),
            kind: Kind::Builtin {
                app: Builtin::Echo,
                full: false,
            },
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The pool its actors run in.
    pub fn pool(&self) -> &str {
        &self.name
    }

    pub fn kind(&self) -> &Kind {
        &self.kind
    }

    /// The built-in app it runs, if it runs one.
    pub fn builtin(&self) -> Option<Builtin> {
        match self.kind {
            Kind::Builtin { app, .. } => Some(app),
            Kind::Program(_) => None,
        }
    }

    /// The program it runs, if it runs one.
    pub fn program(&self) -> Option<&Program> {
        match &self.kind {
            Kind::Program(p) => Some(p),
            Kind::Builtin { .. } => None,
        }
    }

    /// Whether a suspend keeps its memory (built-in apps only).
    pub fn full_snapshot(&self) -> bool {
        matches!(self.kind, Kind::Builtin { full: true, .. })
    }
}

/// `NAME[:data|full[:APP]]` (`--template`): a built-in app's template.
impl FromStr for Template {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut parts = s.split(':');
        let name = parts.next().unwrap_or_default();
        let kind = parts.next().unwrap_or("data");
        let app = parts.next().unwrap_or("counter");
        if parts.next().is_some() {
            return Err(format!("template {s:?}: want NAME[:data|full[:APP]]"));
        }
        let full = match kind {
            "data" => false,
            "full" => true,
            other => return Err(format!("snapshot kind {other:?} must be data or full")),
        };
        let app = app.parse()?;
        Self::new(name, Kind::Builtin { app, full })
    }
}

/// Why a templates file was refused: one line naming the file, the template and the
/// key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("templates file {}: {message}", file.display())]
pub struct TemplatesError {
    pub file: PathBuf,
    pub message: String,
}

/// A set of templates, by name: the built-in `counter` and `echo`, and those of a
/// templates file (which may replace them).
#[derive(Debug, Clone, PartialEq)]
pub struct Templates {
    by_name: BTreeMap<String, Template>,
    file: Option<PathBuf>,
}

impl Default for Templates {
    fn default() -> Self {
        Self::builtin()
    }
}

impl Templates {
    /// `counter` and `echo`.
    pub fn builtin() -> Self {
        let mut by_name = BTreeMap::new();
        for t in [Template::counter(), Template::echo()] {
            by_name.insert(t.name.clone(), t);
        }
        Self {
            by_name,
            file: None,
        }
    }

    /// The built-in templates and those of the file at `path` (relative `dir`s are
    /// taken from the file's directory).
    ///
    /// # Errors
    /// An unreadable or oversized file, bad TOML, an unknown key, a bad value: one line
    /// naming the file, the template and the key.
    pub fn load(path: &Path) -> Result<Self, TemplatesError> {
        let err = |message: String| TemplatesError {
            file: path.to_owned(),
            message,
        };
        let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
        if meta.len() > MAX_FILE_BYTES {
            return Err(err(format!(
                "{} bytes, over the {MAX_FILE_BYTES} bytes a templates file may have",
                meta.len()
            )));
        }
        let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
        let base = std::path::absolute(path)
            .ok()
            .and_then(|p| p.parent().map(Path::to_owned))
            .unwrap_or_default();
        let mut loaded = Self::parse(&text, &base).map_err(err)?;
        loaded.file = Some(path.to_owned());
        Ok(loaded)
    }

    /// The built-in templates and those of `text`, a templates file's content whose
    /// relative `dir`s are taken from `base`.
    ///
    /// # Errors
    /// As [`Templates::load`], without the file's name.
    pub fn parse(text: &str, base: &Path) -> Result<Self, String> {
        let file: toml::Table = toml::from_str(text).map_err(|e| one_line(&e, text))?;
        let mut templates = Self::builtin();
        for (key, value) in file {
            if key != "templates" {
                return Err(format!(
                    "unknown top-level key `{key}` (want [templates.NAME] tables)"
                ));
            }
            let toml::Value::Table(table) = value else {
                return Err("`templates` must be a table of [templates.NAME] tables".into());
            };
            for (name, value) in table {
                let in_template = |m: String| format!("template {name}: {m}");
                if !is_label(&name) {
                    return Err(in_template(LABEL_RULE.to_owned()));
                }
                let raw = RawTemplate::deserialize(value)
                    .map_err(|e| in_template(e.message().to_owned()))?;
                let kind = raw.into_kind(base).map_err(in_template)?;
                templates.by_name.insert(
                    name.clone(),
                    Template {
                        name: name.clone(),
                        kind,
                    },
                );
            }
        }
        Ok(templates)
    }

    /// Adds `template`, replacing one of the same name.
    pub fn insert(&mut self, template: Template) {
        self.by_name.insert(template.name.clone(), template);
    }

    pub fn get(&self, name: &str) -> Option<&Template> {
        self.by_name.get(name)
    }

    /// Every template, by name.
    pub fn iter(&self) -> impl Iterator<Item = &Template> {
        self.by_name.values()
    }

    /// The file they were read from, if any.
    pub fn file(&self) -> Option<&Path> {
        self.file.as_deref()
    }
}

/// A TOML error on one line, with its line number.
fn one_line(e: &toml::de::Error, text: &str) -> String {
    let message = e.message().trim().replace('\n', " ");
    match e.span() {
        Some(span) => {
            let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
            format!("line {line}: {message}")
        }
        None => message,
    }
}

/// A template's table as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTemplate {
    app: Option<String>,
    command: Option<RawCommand>,
    dir: Option<String>,
    #[serde(default)]
    env: BTreeMap<String, String>,
    ready: Option<String>,
    start_timeout: Option<String>,
    stop_signal: Option<String>,
    stop_grace: Option<String>,
    protocol: Option<String>,
    snapshot: Option<String>,
    limits: Option<RawLimits>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawCommand {
    Line(String),
    Words(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    memory: Option<RawSize>,
    cpu: Option<f64>,
    cpu_time: Option<String>,
    open_files: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawSize {
    Bytes(u64),
    Text(String),
}

fn duration(key: &str, value: Option<&str>, default: Duration) -> Result<Duration, String> {
    let Some(value) = value else {
        return Ok(default);
    };
    let d = parse_duration(value).map_err(|e| format!("{key}: {e}"))?;
    if d.is_zero() {
        return Err(format!("{key}: {value:?} must be above 0"));
    }
    if d > MAX_PROGRAM_WAIT {
        return Err(format!(
            "{key}: {value:?} is over the longest accepted, {}s",
            MAX_PROGRAM_WAIT.as_secs()
        ));
    }
    Ok(d)
}

impl RawTemplate {
    fn into_kind(self, base: &Path) -> Result<Kind, String> {
        let full = match self.snapshot.as_deref() {
            None | Some("data") => false,
            Some("full") => true,
            Some(other) => {
                return Err(format!("snapshot: {other:?} must be data or full"));
            }
        };
        match (self.app, self.command) {
            (Some(_), Some(_)) => {
                Err("give either `app` (a built-in app) or `command` (a program), not both".into())
            }
            (None, None) => Err(
                "missing `command` (the program to run) or `app` (a built-in app: counter or echo)"
                    .into(),
            ),
            (Some(app), None) => {
                let app: Builtin = app.parse().map_err(|e| format!("app: {e}"))?;
                let program_keys = [
                    ("dir", self.dir.is_some()),
                    ("env", !self.env.is_empty()),
                    ("ready", self.ready.is_some()),
                    ("start_timeout", self.start_timeout.is_some()),
                    ("stop_signal", self.stop_signal.is_some()),
                    ("stop_grace", self.stop_grace.is_some()),
                    ("protocol", self.protocol.is_some()),
                    ("limits", self.limits.is_some()),
                ];
                if let Some((key, _)) = program_keys.iter().find(|(_, set)| *set) {
                    return Err(format!(
                        "`{key}` applies to programs (`command`), not to the built-in app {}",
                        app.name()
                    ));
                }
                Ok(Kind::Builtin { app, full })
            }
            (None, Some(command)) => {
                if full {
                    return Err("snapshot: \"full\" keeps an app's memory, which needs CRIU or gVisor; a program's snapshot is its data directory (\"data\")".into());
                }
                let command = match command {
                    RawCommand::Line(line) => {
                        split_command(&line).map_err(|e| format!("command: {e}"))?
                    }
                    RawCommand::Words(words) => {
                        if words.first().is_none_or(String::is_empty) {
                            return Err("command: the program (its first word) is empty".into());
                        }
                        words
                    }
                };
                if command.iter().any(|w| w.contains('\0')) {
                    return Err("command: holds a NUL byte".into());
                }
                let dir = self.dir.map(|d| {
                    let d = PathBuf::from(d);
                    if d.is_relative() { base.join(d) } else { d }
                });
                for (k, v) in &self.env {
                    if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                        return Err(format!("env: {k:?} is not a valid environment variable"));
                    }
                    if RESERVED_ENV.contains(&k.as_str()) {
                        return Err(format!(
                            "env: {k} is set by the worker for every program ({})",
                            RESERVED_ENV.join(", ")
                        ));
                    }
                }
                let ready = match self.ready.as_deref() {
                    None => Probe::Http {
                        path: "/".into(),
                        explicit: false,
                    },
                    Some("tcp") => Probe::Tcp,
                    Some(path)
                        if path.starts_with('/')
                            && !path.chars().any(|c| c.is_control() || c == ' ') =>
                    {
                        Probe::Http {
                            path: path.to_owned(),
                            explicit: true,
                        }
                    }
                    Some(other) => {
                        return Err(format!(
                            "ready: {other:?} must be an HTTP path (\"/healthz\") or \"tcp\""
                        ));
                    }
                };
                let protocol = match self.protocol.as_deref() {
                    None | Some("http1") => Protocol::Http1,
                    Some("h2c") => Protocol::H2c,
                    Some(other) => return Err(format!("protocol: {other:?} must be http1 or h2c")),
                };
                let stop_signal = match self.stop_signal.as_deref() {
                    None => StopSignal::Term,
                    Some(s) => s.parse().map_err(|e| format!("stop_signal: {e}"))?,
                };
                let limits = match self.limits {
                    None => Limits::default(),
                    Some(l) => l.into_limits()?,
                };
                Ok(Kind::Program(Box::new(Program {
                    command,
                    dir,
                    env: self.env,
                    ready,
                    start_timeout: duration(
                        "start_timeout",
                        self.start_timeout.as_deref(),
                        DEFAULT_START_TIMEOUT,
                    )?,
                    stop_signal,
                    stop_grace: duration(
                        "stop_grace",
                        self.stop_grace.as_deref(),
                        DEFAULT_STOP_GRACE,
                    )?,
                    protocol,
                    limits,
                })))
            }
        }
    }
}

/// The smallest memory limit accepted: below it no interpreter starts.
pub const MIN_MEMORY: u64 = 16 << 20;

impl RawLimits {
    fn into_limits(self) -> Result<Limits, String> {
        let memory = match self.memory {
            None => None,
            Some(RawSize::Bytes(n)) => Some(n),
            Some(RawSize::Text(s)) => {
                Some(parse_bytes(&s).map_err(|e| format!("limits.memory: {e}"))?)
            }
        };
        if let Some(m) = memory
            && m < MIN_MEMORY
        {
            return Err(format!(
                "limits.memory: {m} bytes is below the smallest accepted, {}MiB",
                MIN_MEMORY >> 20
            ));
        }
        if let Some(cpu) = self.cpu
            && !(cpu.is_finite() && (0.01..=1024.0).contains(&cpu))
        {
            return Err(format!(
                "limits.cpu: {cpu} must be a number of CPUs from 0.01 to 1024"
            ));
        }
        let cpu_time = match self.cpu_time.as_deref() {
            None => None,
            Some(s) => {
                let d = parse_duration(s).map_err(|e| format!("limits.cpu_time: {e}"))?;
                if d < Duration::from_secs(1) {
                    return Err(format!("limits.cpu_time: {s:?} must be at least 1s"));
                }
                Some(d)
            }
        };
        if let Some(n) = self.open_files
            && !(16..=1 << 20).contains(&n)
        {
            return Err(format!("limits.open_files: {n} must be from 16 to 1048576"));
        }
        Ok(Limits {
            memory,
            cpu: self.cpu,
            cpu_time,
            open_files: self.open_files,
        })
    }
}

#[cfg(test)]
mod tests;
