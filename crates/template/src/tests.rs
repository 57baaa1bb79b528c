use super::*;

fn parse(text: &str) -> Result<Templates, String> {
    Templates::parse(text, Path::new("/srv/app"))
}

fn program(t: &Templates, name: &str) -> Program {
    t.get(name).unwrap().program().unwrap().clone()
}

#[test]
fn a_program_with_every_key() {
    let t = parse(
        r#"
[templates.notes]
command = "python3 'my app.py' --port {port}"
dir = "examples/notes"
env = { NOTES_TITLE = "hi" }
ready = "/healthz"
start_timeout = "5s"
stop_signal = "SIGINT"
stop_grace = "2s"
protocol = "h2c"
snapshot = "data"
[templates.notes.limits]
memory = "256MiB"
cpu = 0.5
cpu_time = "10m"
open_files = 1024
"#,
    )
    .unwrap();
    let p = program(&t, "notes");
    assert_eq!(p.command, ["python3", "my app.py", "--port", "{port}"]);
    assert_eq!(p.dir.as_deref(), Some(Path::new("/srv/app/examples/notes")));
    assert_eq!(p.env["NOTES_TITLE"], "hi");
    assert_eq!(
        p.ready,
        Probe::Http {
            path: "/healthz".into(),
            explicit: true
        }
    );
    assert_eq!(p.start_timeout, Duration::from_secs(5));
    assert_eq!(p.stop_signal, StopSignal::Int);
    assert_eq!(p.stop_grace, Duration::from_secs(2));
    assert_eq!(p.protocol, Protocol::H2c);
    assert_eq!(
        p.limits,
        Limits {
            memory: Some(256 << 20),
            cpu: Some(0.5),
            cpu_time: Some(Duration::from_secs(600)),
            open_files: Some(1024),
        }
    );
    assert_eq!(
        p.argv(8123, Path::new("/d")),
        ["python3", "my app.py", "--port", "8123"]
    );
    assert!(!t.get("notes").unwrap().full_snapshot());
    assert_eq!(t.get("notes").unwrap().pool(), "notes");
    assert!(t.get("counter").is_some(), "built-ins stay");
}

#[test]
fn defaults_and_a_command_as_words() {
    let t = parse("[templates.files]\ncommand = [\"python3\", \"-m\", \"http.server\", \"{port}\", \"--directory\", \"{data}\"]\n").unwrap();
    let p = program(&t, "files");
    assert_eq!(p.dir, None);
    assert_eq!(
        p.ready,
        Probe::Http {
            path: "/".into(),
            explicit: false
        }
    );
    assert_eq!(p.start_timeout, DEFAULT_START_TIMEOUT);
    assert_eq!(p.stop_grace, DEFAULT_STOP_GRACE);
    assert_eq!(p.stop_signal, StopSignal::Term);
    assert_eq!(p.protocol, Protocol::Http1);
    assert!(!p.limits.any());
    assert_eq!(
        p.argv(80, Path::new("/var/a b")),
        [
            "python3",
            "-m",
            "http.server",
            "80",
            "--directory",
            "/var/a b"
        ]
    );
}

#[test]
fn built_in_apps_and_their_snapshots() {
    let t = parse("[templates.counter]\napp = \"counter\"\nsnapshot = \"full\"\n[templates.e2]\napp = \"echo\"\n").unwrap();
    assert!(t.get("counter").unwrap().full_snapshot());
    assert_eq!(t.get("e2").unwrap().builtin(), Some(Builtin::Echo));
    assert!(!t.get("e2").unwrap().full_snapshot());
}

/// Each refusal names the template and the key, on one line.
#[test]
fn bad_files_are_refused_naming_the_template_and_the_key() {
    let cases: &[(&str, &str)] = &[
        (
            "[templates.notes]\ncomand = \"x\"\n",
            "template notes: unknown field `comand`",
        ),
        (
            "[templates.notes]\ncommand = \"x\"\nstart_timeout = \"10x\"\n",
            "template notes: start_timeout: \"10x\" is not a duration",
        ),
        (
            "[templates.notes]\ncommand = \"x\"\nstop_grace = \"0\"\n",
            "template notes: stop_grace: \"0\" must be above 0",
        ),
        (
            "[templates.notes]\ncommand = \"x\"\nsnapshot = \"full\"\n",
            "template notes: snapshot: \"full\" keeps an app's memory, which needs CRIU or gVisor",
        ),
        (
            "[templates.notes]\ncommand = \"x 'y\"\n",
            "template notes: command: command \"x 'y\" has unbalanced quotes",
        ),
        (
            "[templates.notes]\ncommand = \"\"\n",
            "template notes: command: command is empty",
        ),
        (
            "[templates.notes]\nready = \"/\"\n",
            "template notes: missing `command`",
        ),
        (
            "[templates.notes]\ncommand = \"x\"\napp = \"counter\"\n",
            "template notes: give either `app`",
        ),
        (
            "[templates.c]\napp = \"counter\"\nready = \"/\"\n",
            "template c: `ready` applies to programs",
        ),
        (
            "[templates.c]\napp = \"clock\"\n",
            "template c: app: app \"clock\" must be one of counter, echo",
        ),
        (
            "[templates.notes]\ncommand = \"x\"\nready = \"healthz\"\n",
            "template notes: ready: \"healthz\" must be an HTTP path",
        ),
        (
            "[templates.notes]\ncommand = \"x\"\nprotocol = \"h3\"\n",
            "template notes: protocol: \"h3\" must be http1 or h2c",
        ),
        (
            "[templates.notes]\ncommand = \"x\"\nstop_signal = \"SIGKILL\"\n",
            "template notes: stop_signal: \"SIGKILL\" is not a stop signal",
        ),
        (
            "[templates.notes]\ncommand = \"x\"\nenv = { PORT = \"1\" }\n",
            "template notes: env: PORT is set by the worker",
        ),
        (
            "[templates.notes]\ncommand = \"x\"\n[templates.notes.limits]\nmemory = \"1MiB\"\n",
            "template notes: limits.memory: 1048576 bytes is below the smallest accepted",
        ),
        (
            "[templates.notes]\ncommand = \"x\"\n[templates.notes.limits]\nmemory = \"lots\"\n",
            "template notes: limits.memory: \"lots\" is not a size",
        ),
        (
            "[templates.notes]\ncommand = \"x\"\n[templates.notes.limits]\ncpu = 0\n",
            "template notes: limits.cpu: 0 must be a number of CPUs",
        ),
        (
            "[templates.notes]\ncommand = \"x\"\n[templates.notes.limits]\nswap = 1\n",
            "template notes: unknown field `swap`",
        ),
        (
            "[templates.Notes]\ncommand = \"x\"\n",
            "template Notes: must be 1-63 characters",
        ),
        (
            "[template.notes]\ncommand = \"x\"\n",
            "unknown top-level key `template`",
        ),
        ("[templates.notes\ncommand = \"x\"\n", "line 1:"),
    ];
    for (text, want) in cases {
        let got = parse(text).unwrap_err();
        assert!(
            got.starts_with(want),
            "{text:?}: got {got:?}, want {want:?}"
        );
        assert!(!got.contains('\n'), "one line: {got:?}");
    }
}

#[test]
fn a_file_names_itself_in_its_errors_and_bases_dirs_on_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("t.toml");
    std::fs::write(&file, "[templates.a]\ncommand = \"./run\"\ndir = \"app\"\n").unwrap();
    let t = Templates::load(&file).unwrap();
    let p = program(&t, "a");
    assert_eq!(p.dir.as_deref(), Some(dir.path().join("app").as_path()));
    assert_eq!(t.file(), Some(file.as_path()));
    let e = p.check_runnable().unwrap_err();
    assert!(e.starts_with("dir "), "{e}");
    std::fs::create_dir(dir.path().join("app")).unwrap();
    let e = p.check_runnable().unwrap_err();
    assert!(e.contains("run cannot be used"), "{e}");
    std::fs::write(dir.path().join("app/run"), "#!/bin/sh\n").unwrap();
    let e = p.check_runnable().unwrap_err();
    assert!(e.ends_with("is not executable"), "{e}");
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(
            dir.path().join("app/run"),
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
    }
    p.check_runnable().unwrap();

    std::fs::write(&file, "[templates.a]\ncommand = 1\n").unwrap();
    let e = Templates::load(&file).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!("templates file {}: template a:", file.display())),
        "{e}"
    );
    let e = Templates::load(&dir.path().join("missing.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.toml: No such file"), "{e}");
}

#[test]
fn a_command_not_on_path_is_named() {
    let p = Program::from_command_line("valet-no-such-program --x", None).unwrap();
    assert_eq!(
        p.check_runnable().unwrap_err(),
        "command \"valet-no-such-program\" is not found on PATH"
    );
    let sh = Program::from_command_line("sh -c 'exit 0'", None).unwrap();
    assert!(sh.executable().unwrap().ends_with("sh"));
    assert!(Program::from_command_line("  ", None).is_err());
}

#[test]
fn the_template_flag() {
    assert_eq!("counter".parse::<Template>().unwrap(), Template::counter());
    let t: Template = "big:full".parse().unwrap();
    assert!(t.full_snapshot());
    assert_eq!(t.pool(), "big");
    assert!("big:half".parse::<Template>().is_err());
    assert!("Big".parse::<Template>().is_err());
    let e: Template = "e2:data:echo".parse().unwrap();
    assert_eq!(e.builtin(), Some(Builtin::Echo));
    assert!("e3:data:nope".parse::<Template>().is_err());
}

#[test]
fn probes() {
    let default = Probe::Http {
        path: "/".into(),
        explicit: false,
    };
    assert!(default.ready_with(404) && default.ready_with(200) && !default.ready_with(503));
    let health = Probe::Http {
        path: "/healthz".into(),
        explicit: true,
    };
    assert!(health.ready_with(204) && health.ready_with(302));
    assert!(!health.ready_with(404) && !health.ready_with(500));
}

proptest::proptest! {
    /// No input makes the parser panic, and every refusal is one line.
    #[test]
    fn any_text_is_parsed_or_refused_on_one_line(text in "\\PC{0,200}") {
        if let Err(e) = parse(&text) {
            proptest::prop_assert!(!e.contains('\n'));
        }
    }
}
