//! `sluice nar`: `dump` a path as a NAR (`nix-store --dump`), `restore` a NAR into a
//! directory (`nix-store --restore`), `ls` a NAR file (`nix nar ls`).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use sluice_nix::nar::listing::{list, TextOptions};
use sluice_store::local::{dump_fs_path, restore_nar};

/// `sluice nar` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Write the NAR serialisation of PATH to standard output.
    Dump { path: PathBuf },
    /// Unpack the NAR on standard input into DIR, which must not exist.
    Restore { dir: PathBuf },
    /// List the contents of a NAR file.
    Ls {
        /// List subdirectories recursively.
        #[arg(short = 'R', long)]
        recursive: bool,
        /// Long format: type, permissions, size, symlink targets.
        #[arg(short = 'l', long)]
        long: bool,
        /// Show directories themselves, not their contents.
        #[arg(short = 'd', long)]
        directory: bool,
        /// Print JSON as `nix nar ls --json` does.
        #[arg(long)]
        json: bool,
        /// The NAR file.
        file: PathBuf,
        /// The path inside the NAR.
        #[arg(default_value = "/")]
        path: String,
    },
}

/// Runs a `sluice nar` subcommand.
pub fn run(cmd: Command) -> Result<ExitCode, String> {
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    match cmd {
        Command::Dump { path } => dump_fs_path(&path, &mut out).map_err(|e| format!("dumping {}: {e}", path.display()))?,
        Command::Restore { dir } => {
            let stdin = std::io::stdin();
            restore_nar(&mut stdin.lock(), &dir).map_err(|e| format!("restoring into {}: {e}", dir.display()))?;
        }
        Command::Ls { recursive, long, directory, json, file, path } => {
            let f = std::fs::File::open(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            let root = list(std::io::BufReader::new(f)).map_err(|e| format!("{}: {e}", file.display()))?;
            let node = root.find(&path).ok_or_else(|| format!("{}: no path {path:?} in the NAR", file.display()))?;
            if json {
                out.write_all(&node.to_json(recursive)).map_err(|e| e.to_string())?;
            } else {
                let label = path.trim_end_matches('/').rsplit('/').next().filter(|l| !l.is_empty()).unwrap_or(".");
                out.write_all(&node.to_text(label, TextOptions { long, recursive, directory })).map_err(|e| e.to_string())?;
            }
        }
    }
    out.flush().map_err(|e| e.to_string())?;
    Ok(ExitCode::SUCCESS)
}
