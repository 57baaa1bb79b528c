//! `valet envoy-bootstrap`.

use std::process::ExitCode;

use valet_extproc::bootstrap::{EnvoyListeners, bootstrap_yaml};

use crate::EXIT_CONFIG;
use crate::cli::EnvoyBootstrapArgs;

pub(crate) fn run(args: &EnvoyBootstrapArgs) -> ExitCode {
    let config = match args.router.resolve() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("valet envoy-bootstrap: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let listeners = EnvoyListeners {
        http: args.envoy_listen,
        admin: args.envoy_admin,
    };
    match bootstrap_yaml(&config, listeners) {
        Ok(yaml) => {
            print!("{yaml}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("valet envoy-bootstrap: {e}");
            ExitCode::from(EXIT_CONFIG)
        }
    }
}
