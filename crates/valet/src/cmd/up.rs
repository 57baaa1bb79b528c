//! `valet up`: the reference control plane, its workers and the router in one process
//! on loopback.

use std::process::ExitCode;

use valet_control::ActorKey;
use valet_embedded::{Embedded, EmbeddedConfig, PoolSpec};

use crate::EXIT_CONFIG;
use crate::cli::UpArgs;
use crate::serve::RunningRouter;

pub(crate) async fn run(args: UpArgs) -> ExitCode {
    // Before anything is printed: see `signal::terminated`.
    let terminated = crate::signal::terminated();
    match up(args, terminated).await {
        Ok(()) | Err(UpError::Checked) => ExitCode::SUCCESS,
        Err(UpError::Config(e)) => {
            say_usage!("valet up: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(UpError::Start(e)) => {
            say_err!("valet up: {e}");
            ExitCode::FAILURE
        }
    }
}

enum UpError {
    Config(String),
    Start(String),
    /// `--check`: the configuration is valid and was printed; nothing started.
    Checked,
}

fn demo_actors(spec: &str) -> Result<Vec<ActorKey>, String> {
    spec.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            let (a, n) = s.split_once('/').ok_or_else(|| {
                format!(
                    "invalid configuration: --demo-actors={spec}: {s:?} is not <atespace>/<name>"
                )
            })?;
            ActorKey::new(a, n).map_err(|e| {
                format!(
                    "invalid configuration: --demo-actors={spec}: {}",
                    e.message()
                )
            })
        })
        .collect()
}

async fn up(
    args: UpArgs,
    terminated: impl std::future::Future<Output = ()>,
) -> Result<(), UpError> {
    let shutdown_timeout = args.plane.shutdown_timeout;
    // A signal during the start stops it there (what started stops with the process;
    // nothing is acknowledged yet): never held until the start ends.
    let mut terminated = std::pin::pin!(terminated);
    let (embedded, running) = tokio::select! {
        started = start(args) => started?,
        () = &mut terminated => {
            tracing::info!("stopped during the start");
            return Ok(());
        }
    };
    say!("press Ctrl-C to stop");

    terminated.await;
    running.drain().await;
    embedded.checkpoint_all(shutdown_timeout).await;
    embedded.shutdown().await;
    tracing::info!("valet up stopped");
    Ok(())
}

/// The router's flags (and the HTTPS ingress's) resolved as they will be, before
/// anything is written: with --tls, the throwaway CA and ingress certificate do not
/// exist yet, so the flags they stand in for are checked without them (and again,
/// whole, once they are made).
fn precheck(args: &UpArgs) -> Result<valet_router::RouterConfig, UpError> {
    let https = args.tls || args.plane.security.tls_cert_file.is_some();
    let mut router = args.router.clone();
    if let Some((flag, value)) = router.ateapi.given().into_iter().next()
        && !https
    {
        return Err(UpError::Config(format!(
            "invalid configuration: {flag}={value}: the embedded control plane serves plaintext; needs --tls (or --tls-cert-file and --tls-key-file)"
        )));
    }
    let scheme = if https { "https" } else { "http" };
    router.control_plane = format!("{scheme}://{}", args.control_plane_listen);
    if args.tls && router.ateapi.ateapi_ca_file.is_none() {
        // Checked whole once the throwaway CA is made; the rules between the flags
        // now.
        router
            .ateapi
            .check_pairs()
            .map_err(|e| UpError::Config(e.to_string()))?;
        router.control_plane = format!("http://{}", args.control_plane_listen);
        router.ateapi = valet_router::config::AteapiArgs::default();
    }
    let config = router
        .resolve()
        .map_err(|e| UpError::Config(e.to_string()))?;
    // Without certificate files (--tls makes them later), checked with a certificate
    // made in memory.
    args.ingress.check().map_err(UpError::Config)?;
    Ok(config)
}

/// Everything `valet up` runs, started: its control plane and workers, then its
/// router.
/// The templates `valet up` knows (its flags' and file's, and `app` from --app), and
/// the demo pool's, checked as runnable here.
fn up_templates(
    args: &UpArgs,
) -> Result<
    (
        valet_template::Templates,
        String,
        Option<valet_worker::Cgroup>,
    ),
    UpError,
> {
    let mut templates = args.plane.templates.resolve().map_err(UpError::Config)?;
    if let Some(app) = &args.app {
        let dir = std::env::current_dir().ok();
        let program = valet_template::Program::from_command_line(app, dir)
            .map_err(|e| UpError::Config(format!("invalid configuration: --app={app:?}: {e}")))?;
        let template =
            valet_template::Template::new("app", valet_template::Kind::Program(Box::new(program)))
                .map_err(UpError::Config)?;
        templates.insert(template);
    }
    let demo = args
        .demo_template
        .clone()
        .unwrap_or_else(|| if args.app.is_some() { "app" } else { "counter" }.to_owned());
    let Some(template) = templates.get(&demo) else {
        let known: Vec<&str> = templates
            .iter()
            .map(valet_template::Template::name)
            .collect();
        return Err(UpError::Config(format!(
            "invalid configuration: --demo-template={demo}: no such template (known: {})",
            known.join(", ")
        )));
    };
    let cgroup = match args.cgroup.as_deref().map(valet_worker::Cgroup::open) {
        None => None,
        Some(Ok(c)) => Some(c),
        Some(Err(e)) => return Err(UpError::Config(format!("invalid configuration: {e}"))),
    };
    valet_worker::check_template(template, cgroup.as_ref()).map_err(|e| {
        let flag = if args.app.is_some() && demo == "app" {
            "--app"
        } else {
            "--templates"
        };
        UpError::Config(format!("invalid configuration: {flag}: {e}"))
    })?;
    Ok((templates, demo, cgroup))
}

async fn start(mut args: UpArgs) -> Result<(Embedded, RunningRouter), UpError> {
    let actors = demo_actors(&args.demo_actors).map_err(UpError::Config)?;
    if args.workers == 0 {
        return Err(UpError::Config(
            "invalid configuration: --workers=0: must be >= 1".into(),
        ));
    }
    let (templates, demo, cgroup) = up_templates(&args)?;
    let plane = args
        .plane
        .plane_config(&templates)
        .map_err(UpError::Config)?;
    // The workers present the router's credentials: what the embedded control plane
    // asks of its clients, they must bring, or they would never join.
    let jwt = args.plane.security.jwt_flag();
    if let Some(jwt) = &jwt
        && args.router.ateapi.ateapi_auth != Some(valet_router::config::AteapiAuth::Jwt)
    {
        return Err(UpError::Config(format!(
            "invalid configuration: {jwt}: the embedded control plane then asks for bearer tokens, which its workers and the router send only with --ateapi-auth jwt and --ateapi-token-file"
        )));
    }
    if let Some(ca) = &args.plane.security.client_ca_file
        && args.router.ateapi.ateapi_cert_file.is_none()
    {
        return Err(UpError::Config(format!(
            "invalid configuration: --client-ca-file={}: the embedded control plane then asks for client certificates, which its workers and the router present only with --ateapi-cert-file and --ateapi-key-file",
            ca.display()
        )));
    }
    // The embedded control plane's server side: its own flags (files read, nothing
    // written); with --tls, the throwaway certificate for what they leave out, below.
    // With --tls and no --tls-cert-file, the client CA goes with the throwaway
    // certificate (checked once that is made).
    let throwaway_client_ca = if args.tls && args.plane.security.tls_cert_file.is_none() {
        args.plane.security.client_ca_file.take()
    } else {
        None
    };
    let mut server = args
        .plane
        .security
        .resolve()
        .map_err(|e| UpError::Config(e.to_string()))?;
    if let Some(jwt) = jwt.filter(|_| server.jwt.is_some() && server.tls.is_none() && !args.tls) {
        return Err(UpError::Config(format!(
            "invalid configuration: {jwt}: bearer tokens need TLS (--tls, or --tls-cert-file and --tls-key-file)"
        )));
    }
    let metrics_listen =
        crate::cmd::control_plane::optional_listen("--metrics-listen", &args.plane.metrics_listen)
            .map_err(UpError::Config)?;
    if args.check && args.tls {
        return Err(UpError::Config(
            "invalid configuration: --check: not with --tls, whose certificates are made at the start".into(),
        ));
    }
    // With --tls, HTTPS on 127.0.0.1:8443 unless --listen-https was given (empty: off).
    if args.tls && args.ingress.listen_https.is_empty() && !args.listen_https_given {
        args.ingress.listen_https = DEFAULT_UP_LISTEN_HTTPS.into();
    }
    // Every flag is checked before the data dir is touched: a mistake exits 64 with
    // its one line and nothing written (and is named even while another `valet up`
    // holds the dir). What the throwaway certificates stand in for is checked once
    // they are made, below.
    let config = precheck(&args)?;
    if let Some(ca) = &throwaway_client_ca {
        valet_control::auth::check_client_ca(ca).map_err(|e| UpError::Config(e.to_string()))?;
    }
    let https_listen = args.ingress.listen_https.parse().ok();
    let listeners = [
        ("--control-plane-listen", Some(args.control_plane_listen)),
        ("--metrics-listen", metrics_listen),
        ("--listen", config.listen()),
        ("--listen-https", https_listen),
        ("--extproc-listen", config.extproc_listen()),
        ("--admin-listen", config.admin_listen()),
    ];
    valet_router::config::distinct_listeners(&listeners)
        .map_err(|e| UpError::Config(e.to_string()))?;
    if args.check {
        for (flag, value) in config.with_flags(args.ingress.given()).effective_flags() {
            say!("{flag}={value}");
        }
        return Err(UpError::Checked);
    }
    // Every port before the data dir: one that is taken (another `valet up`, say)
    // exits 1 naming its flag with nothing written.
    ports_free(&listeners).map_err(UpError::Start)?;
    // The data dir's lock before anything is written into it (the throwaway TLS files
    // below): another `valet up` on the same dir keeps its own.
    let store = valet_control::SqliteStore::open(&args.data_dir)
        .map_err(|e| UpError::Start(e.to_string()))?;
    let tls = if args.tls {
        // Clients dial the listen addresses as given (`0.0.0.0` included): the
        // certificates name them besides the loopback names.
        let mut ips = vec![args.control_plane_listen.ip()];
        ips.extend(
            args.ingress
                .listen_https
                .parse::<std::net::SocketAddr>()
                .map(|a| a.ip()),
        );
        Some(UpTls::generate(&args.data_dir.join("tls"), &ips).map_err(UpError::Start)?)
    } else {
        None
    };
    if let Some(t) = &tls
        && server.tls.is_none()
    {
        server.tls = Some(
            valet_control::auth::server_tls(&t.cp_cert, &t.cp_key, throwaway_client_ca.as_deref())
                .map_err(|e| UpError::Start(e.to_string()))?,
        );
    }
    let scheme = if server.tls.is_some() {
        "https"
    } else {
        "http"
    };
    if let Some(t) = &tls
        && args.router.ateapi.ateapi_ca_file.is_none()
    {
        args.router.ateapi.ateapi_ca_file = Some(t.ca.clone());
    }
    // Validate the router's flags before anything is bound; the workers use the same
    // credentials as the router.
    args.router.control_plane = format!("{scheme}://{}", args.control_plane_listen);
    let embedded_tls = match args.router.resolve() {
        Ok(config) if scheme == "https" => Some(valet_embedded::EmbeddedTls {
            server,
            client: config.credentials().clone(),
        }),
        Ok(_) => None,
        Err(e) => return Err(UpError::Config(e.to_string())),
    };

    // The router's HTTPS flags, as `valet router` takes them; with --tls, the throwaway
    // ingress certificate unless one was given.
    if let Some(t) = &tls
        && args.ingress.ingress_tls_cert_file.is_none()
        && !args.ingress.listen_https.is_empty()
    {
        args.ingress.ingress_tls_cert_file = Some(t.ingress_cert.clone());
        args.ingress.ingress_tls_key_file = Some(t.ingress_key.clone());
    }
    let https = args.ingress.resolve().map_err(UpError::Config)?;
    let embedded = Embedded::start_on(
        store,
        EmbeddedConfig {
            data_dir: args.data_dir.clone(),
            listen: args.control_plane_listen,
            metrics_listen,
            shutdown_timeout: args.plane.shutdown_timeout,
            tls: embedded_tls,
            plane,
            restore_delay: args.restore_delay,
            templates: templates.clone(),
            snapshot_max_bytes: args.snapshot_max_bytes,
            cgroup,
            pools: vec![
                PoolSpec {
                    pool: demo.clone(),
                    workers: args.workers,
                    id_prefix: "up-worker".into(),
                },
                PoolSpec {
                    pool: "echo".into(),
                    workers: args.echo_workers,
                    id_prefix: "up-echo".into(),
                },
            ],
        },
    )
    .await
    .map_err(UpError::Start)?;
    // From here on the embedded system runs: an error below stops it cleanly (its workers
    // detach, its store closes) before the error is reported.
    let started = async {
        let cp_addr = embedded.addr;
        say!("listening control-plane {cp_addr}");
        if let Some(m) = embedded.metrics_addr {
            say!("listening metrics {m}");
        }
        let plane = embedded.plane.clone();
        let n = args.workers;

        for key in &actors {
            match plane.catalog().create_atespace(key.atespace()).await {
                Ok(_) => {}
                Err(e) if e.code() == tonic::Code::AlreadyExists => {}
                Err(e) => {
                    return Err(UpError::Start(format!(
                        "atespace {}: {}",
                        key.atespace(),
                        e.message()
                    )));
                }
            }
            match plane
                .catalog()
                .create_actor(key.clone(), "default", &demo, Vec::new())
                .await
            {
                Ok(_) => {}
                Err(e) if e.code() == tonic::Code::AlreadyExists => {
                    if let Ok(a) = plane.catalog().get_actor(key)
                        && a.actor_template_name != demo
                    {
                        say!(
                            "valet up: actor {key} exists with template {} (not {demo}): it runs in pool {}; delete it (valet ctl actor delete {key}) or use another --data-dir",
                            a.actor_template_name,
                            a.worker_pool_name
                        );
                    }
                }
                Err(e) => return Err(UpError::Start(format!("actor {key}: {}", e.message()))),
            }
        }

        args.router.control_plane = format!("{scheme}://{cp_addr}");
        let config = args
            .router
            .resolve()
            .map_err(|e| UpError::Config(e.to_string()))?
            .with_flags(args.ingress.given());
        let domain = config.actor_domain().to_string();
        let running = RunningRouter::start(config, https)
            .await
            .map_err(UpError::Start)?;
        let names: Vec<String> = actors.iter().map(ToString::to_string).collect();
        say!(
            "valet up: pool {demo} with {n} workers; actors {}; data in {}",
            if names.is_empty() {
                "none".to_owned()
            } else {
                names.join(" ")
            },
            args.data_dir.display()
        );
        if let (Some(router), Some(first)) = (running.addr("router"), actors.first()) {
            say!(
                "try: curl -H 'Host: {}.{}.{domain}' http://{router}/",
                first.name(),
                first.atespace()
            );
        }
        if let (Some(https), Some(first), Some(t)) =
            (running.addr("router-https"), actors.first(), &tls)
        {
            say!(
                "try: curl --cacert {} -H 'Host: {}.{}.{domain}' https://{https}/",
                t.ca.display(),
                first.name(),
                first.atespace()
            );
        }
        if let Some(admin) = running.addr("admin") {
            say!("status: http://{admin}/statusz   metrics: http://{admin}/metrics");
        }
        Ok::<_, UpError>(running)
    }
    .await;
    match started {
        Ok(running) => Ok((embedded, running)),
        Err(e) => {
            embedded.shutdown().await;
            Err(e)
        }
    }
}

/// Whether each fixed address (port 0 picks one: always free) can be listened on now;
/// the first that cannot, named by its flag. The probe's socket closes at once, and
/// the part binds the address again moments later.
fn ports_free(listeners: &[(&str, Option<std::net::SocketAddr>)]) -> Result<(), String> {
    for (flag, addr) in listeners {
        if let Some(addr) = addr.filter(|a| a.port() != 0) {
            std::net::TcpListener::bind(addr)
                .map_err(|e| format!("cannot listen on {flag}={addr}: {e}"))?;
        }
    }
    Ok(())
}

/// `--listen-https` of `valet up --tls` when none is given.
const DEFAULT_UP_LISTEN_HTTPS: &str = "127.0.0.1:8443";

/// The throwaway PKI of `valet up --tls`: one CA, a certificate for the control plane
/// and one for the HTTPS ingress, both for `localhost`, `127.0.0.1`, `::1` and the
/// addresses the parts listen on.
struct UpTls {
    ca: std::path::PathBuf,
    cp_cert: std::path::PathBuf,
    cp_key: std::path::PathBuf,
    ingress_cert: std::path::PathBuf,
    ingress_key: std::path::PathBuf,
}

impl UpTls {
    fn generate(dir: &std::path::Path, ips: &[std::net::IpAddr]) -> Result<Self, String> {
        use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
        let e = |what: &str, err: &dyn std::fmt::Display| format!("--tls: {what}: {err}");
        std::fs::create_dir_all(dir).map_err(|x| e(&dir.display().to_string(), &x))?;
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|x| e(&dir.display().to_string(), &x))?;
        }
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(|x| e("CA", &x))?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "valet up throwaway CA");
        let key = KeyPair::generate().map_err(|x| e("CA key", &x))?;
        let ca = CertifiedIssuer::self_signed(params, key).map_err(|x| e("CA", &x))?;
        let write = |name: &str, pem: &str| -> Result<std::path::PathBuf, String> {
            let p = dir.join(name);
            std::fs::write(&p, pem).map_err(|x| e(&p.display().to_string(), &x))?;
            Ok(p)
        };
        let mut names: Vec<String> = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
        for ip in ips {
            if !names.contains(&ip.to_string()) {
                names.push(ip.to_string());
            }
        }
        let leaf = |name: &str| -> Result<(std::path::PathBuf, std::path::PathBuf), String> {
            let key = KeyPair::generate().map_err(|x| e(name, &x))?;
            let cert = CertificateParams::new(names.clone())
                .and_then(|p| p.signed_by(&key, &ca))
                .map_err(|x| e(name, &x))?;
            // Keys readable by their owner only, from their creation on.
            let key_file = dir.join(format!("{name}.key"));
            {
                use std::io::Write as _;
                use std::os::unix::fs::OpenOptionsExt as _;
                let _ = std::fs::remove_file(&key_file);
                std::fs::OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&key_file)
                    .and_then(|mut f| f.write_all(key.serialize_pem().as_bytes()))
                    .map_err(|x| e(&key_file.display().to_string(), &x))?;
            }
            Ok((write(&format!("{name}.pem"), &cert.pem())?, key_file))
        };
        let (cp_cert, cp_key) = leaf("control-plane")?;
        let (ingress_cert, ingress_key) = leaf("ingress")?;
        Ok(Self {
            ca: write("ca.pem", &ca.as_ref().pem())?,
            cp_cert,
            cp_key,
            ingress_cert,
            ingress_key,
        })
    }
}
