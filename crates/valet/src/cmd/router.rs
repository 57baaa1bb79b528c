//! `valet router`.

use std::process::ExitCode;

use crate::EXIT_CONFIG;
use crate::cli::RouterCmd;
use crate::serve::RunningRouter;

pub(crate) async fn run(cmd: RouterCmd) -> ExitCode {
    // Before anything is printed: see `signal::terminated`.
    let terminated = crate::signal::terminated();
    let config = match cmd.args.resolve() {
        Ok(c) => c.with_flags(cmd.ingress.given()),
        Err(e) => {
            say_usage!("valet router: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let listeners = [
        ("--listen", config.listen()),
        ("--extproc-listen", config.extproc_listen()),
        ("--admin-listen", config.admin_listen()),
        ("--listen-https", cmd.ingress.listen_https.parse().ok()),
    ];
    if let Err(e) = valet_router::config::distinct_listeners(&listeners) {
        say_usage!("valet router: {e}");
        return ExitCode::from(EXIT_CONFIG);
    }
    let https = match cmd.ingress.resolve() {
        Ok(h) => h,
        Err(e) => {
            say_usage!("valet router: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    if cmd.check {
        for (flag, value) in config.effective_flags() {
            say!("{flag}={value}");
        }
        return ExitCode::SUCCESS;
    }
    let running = match RunningRouter::start(config, https).await {
        Ok(r) => r,
        Err(e) => {
            say_err!("valet router: {e}");
            return ExitCode::FAILURE;
        }
    };
    terminated.await;
    running.drain().await;
    ExitCode::SUCCESS
}
