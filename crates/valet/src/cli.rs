//! The command-line tree: one subcommand per part (`cli.md`, "Subcommands").

use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{Parser, Subcommand};
use valet_router::RouterArgs;

use crate::EXIT_CONFIG;

/// valet: a request-parking router for actor platforms.
#[derive(Debug, Parser)]
#[command(name = "valet", version, about, propagate_version = true)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// The router alone: parks requests for actors whose pool is full.
    Router(RouterArgs),
}

/// Prints a command-line error and picks the exit status: 0 for `--help` and
/// `--version`, 64 (one line naming the flag, the value and the rule) for the rest.
pub(crate) fn parse_error_exit(e: &clap::Error) -> ExitCode {
    match e.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                ExitCode::from(EXIT_CONFIG)
            } else {
                ExitCode::SUCCESS
            }
        }
        _ => {
            let rendered = e.render().to_string();
            let line = rendered
                .lines()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("invalid command line");
            eprintln!("{line}");
            ExitCode::from(EXIT_CONFIG)
        }
    }
}
