//! `valet`: the request-parking router, its reference control plane and workers, in
//! one binary. See `../shared/spec/cli.md` for the command-line contract.

#![forbid(unsafe_code)]

mod cli;

use std::process::ExitCode;

use clap::Parser;

use cli::{Cli, Command};

/// Exit status of an invalid configuration (`EX_USAGE`).
const EXIT_CONFIG: u8 = 64;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return cli::parse_error_exit(&e),
    };
    match cli.command {
        Command::Router(args) => {
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
            println!(
                "valet router: the data planes are not built yet; configuration is valid, exiting"
            );
            ExitCode::SUCCESS
        }
    }
}
