//! `valet worker`.

use std::process::ExitCode;

use valet_worker::{Worker, WorkerConfig};

use crate::EXIT_CONFIG;
use crate::cli::WorkerArgs;

pub(crate) async fn run(args: WorkerArgs) -> ExitCode {
    // Before anything is printed: see `signal::terminated`.
    let terminated = crate::signal::terminated();
    let resolved = valet_router::config::parse_control_planes(&args.control_plane)
        .and_then(|urls| Ok((args.ateapi.credentials(&urls[0])?, urls.join(","))));
    let (credentials, control_plane) = match resolved {
        Ok(r) => r,
        Err(e) => {
            say_usage!("valet worker: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if args.listen.ip().is_unspecified() && args.advertise_address.is_none() {
        say_usage!(
            "valet worker: invalid configuration: --listen={}: routers cannot reach an unspecified address; give --advertise-address (the pod IP)",
            args.listen
        );
        return ExitCode::from(EXIT_CONFIG);
    }
    if let Some(ip) = args.advertise_address.filter(|ip| ip.is_unspecified()) {
        say_usage!(
            "valet worker: invalid configuration: --advertise-address={ip}: must be an address routers can reach, not 0.0.0.0 or ::"
        );
        return ExitCode::from(EXIT_CONFIG);
    }
    let templates = match &args.templates {
        Some(f) => match valet_template::Templates::load(f) {
            Ok(t) => t,
            Err(e) => {
                say_usage!(
                    "valet worker: invalid configuration: --templates={}: {}",
                    f.display(),
                    e.message
                );
                return ExitCode::from(EXIT_CONFIG);
            }
        },
        None => valet_template::Templates::builtin(),
    };
    let cgroup = match args.cgroup.as_deref().map(valet_worker::Cgroup::open) {
        None => None,
        Some(Ok(c)) => Some(c),
        Some(Err(e)) => {
            say_usage!("valet worker: invalid configuration: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let worker = match Worker::spawn(WorkerConfig {
        control_plane,
        credentials,
        pool: args.pool,
        listen: args.listen,
        snapshot_dir: args.snapshot_dir,
        restore_delay: args.restore_delay,
        worker_id: args.worker_id,
        advertise: args.advertise_address,
        templates,
        run_dir: args.run_dir,
        snapshot_max_bytes: args.snapshot_max_bytes,
        cgroup,
    })
    .await
    {
        Ok(w) => w,
        Err(valet_worker::WorkerError::Template(e)) => {
            say_usage!("valet worker: invalid configuration: --templates: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
        Err(e) => {
            say_err!("valet worker: {e}");
            return ExitCode::FAILURE;
        }
    };
    say!("listening worker {}", worker.app_addr());
    tracing::info!(worker = worker.id(), app = %worker.app_addr(), "worker started");
    terminated.await;
    worker.drain(args.drain_timeout).await;
    ExitCode::SUCCESS
}
