//! `valet worker`.

use std::process::ExitCode;

use valet_worker::{Worker, WorkerConfig};

use crate::EXIT_CONFIG;
use crate::cli::WorkerArgs;

pub(crate) async fn run(args: WorkerArgs) -> ExitCode {
    // Before anything is printed: see `signal::terminated`.
    let terminated = crate::signal::terminated();
    if !args.control_plane.starts_with("http://") {
        eprintln!(
            "valet worker: invalid configuration: --control-plane={}: must be http://<host>:<port> (h2c)",
            args.control_plane
        );
        return ExitCode::from(EXIT_CONFIG);
    }
    let worker = match Worker::spawn(WorkerConfig {
        control_plane: args.control_plane,
        pool: args.pool,
        listen: args.listen,
        snapshot_dir: args.snapshot_dir,
        restore_delay: args.restore_delay,
        worker_id: args.worker_id,
    })
    .await
    {
        Ok(w) => w,
        Err(e) => {
            eprintln!("valet worker: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("listening worker {}", worker.app_addr());
    tracing::info!(worker = worker.id(), app = %worker.app_addr(), "worker started");
    terminated.await;
    worker.shutdown().await;
    ExitCode::SUCCESS
}
