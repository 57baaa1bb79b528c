//! `valet router`.

use std::process::ExitCode;

use valet_router::RouterArgs;

use crate::EXIT_CONFIG;

pub(crate) async fn run(args: RouterArgs) -> ExitCode {
    let config = match args.resolve() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("valet router: {e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    println!("valet router: resolved configuration");
    for (flag, value) in config.effective_flags() {
        println!("  {flag}={value}");
    }
    println!("valet router: the data planes are not built yet; configuration is valid, exiting");
    ExitCode::SUCCESS
}
