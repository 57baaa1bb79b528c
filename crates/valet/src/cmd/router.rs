//! `valet router`.

use std::process::ExitCode;

use valet_router::RouterArgs;

use crate::EXIT_CONFIG;
use crate::serve::RunningRouter;

pub(crate) async fn run(args: RouterArgs) -> ExitCode {
    let config = match args.resolve() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("valet router: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let running = match RunningRouter::start(config).await {
        Ok(r) => r,
        Err(e) => {
            eprintln!("valet router: {e}");
            return ExitCode::FAILURE;
        }
    };
    crate::signal::terminated().await;
    running.drain().await;
    ExitCode::SUCCESS
}
