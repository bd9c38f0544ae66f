//! `sluice nar`: `dump` a path as a NAR (`nix-store --dump`), `restore` a NAR into a
//! directory (`nix-store --restore`), `ls` a NAR file (`nix nar ls`), `cat` a file in it (`nix nar cat`).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use sluice_local_store::{dump_fs_path, restore_nar};
use sluice_nix::nar::listing::{list_whole, JsonKeys, NarEntry, TextOptions};

use crate::as_nix::NixVersion;

/// `sluice nar` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Write the NAR serialisation of PATH to standard output.
    Dump {
        /// The file, directory or symlink to serialise (not followed).
        path: PathBuf,
    },
    /// Unpack the NAR on standard input into DIR, which must not exist; the input must end
    /// where the NAR does.
    Restore {
        /// The directory to create.
        dir: PathBuf,
    },
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
        /// Read the path and print JSON as this Nix version does: 2.26 takes any spelling of a
        /// path (`share`, `/share/`, `/a/../share`) and sorts JSON keys; 2.8 takes only `/`
        /// and exact absolute paths (`/share`) and puts `type` first.
        #[arg(long, value_enum, default_value = "2.26", value_name = "VERSION")]
        as_nix: NixVersion,
        /// The NAR file.
        file: PathBuf,
        /// The path inside the NAR (`/` for its root).
        path: String,
    },
    /// Print the contents of a regular file inside a NAR file.
    Cat {
        /// Read the path as this Nix version does (see `ls`).
        #[arg(long, value_enum, default_value = "2.26", value_name = "VERSION")]
        as_nix: NixVersion,
        /// The NAR file.
        file: PathBuf,
        /// The path of a regular file inside the NAR.
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
        Command::Cat { as_nix, file, path } => {
            let (root, components) = open_listing(&file, &path, as_nix)?;
            // Nix 2.26's `nar cat` shows a path that is there as a `CanonPath` (`cat.cc`), one
            // that is not as its NAR accessor does (`«unknown»/…`).
            let shown = |accessor: &str| match as_nix {
                NixVersion::V2_26 => format!("{accessor}/{}", components.join("/")),
                NixVersion::V2_8 => path.clone(),
            };
            // Nix 2.8's NAR accessor walks every character of a path that is not empty, and
            // needs a directory to do so: `/` of a lone file's NAR is not there.
            let found = match (as_nix, &root) {
                (NixVersion::V2_8, NarEntry::Regular { .. } | NarEntry::Symlink { .. }) if !path.is_empty() => None,
                _ => root.find(components.iter().copied()),
            };
            let Some(NarEntry::Regular { size, nar_offset, .. }) = found else {
                return Err(match found {
                    Some(_) => format!("path '{}' is not a regular file", shown("")),
                    None => format!("path '{}' does not exist", shown("«unknown»")),
                });
            };
            use std::io::{Read, Seek};
            let mut f = std::fs::File::open(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            f.seek(std::io::SeekFrom::Start(*nar_offset)).map_err(|e| format!("{}: {e}", file.display()))?;
            std::io::copy(&mut f.take(*size), &mut out).map_err(|e| format!("{}: {e}", file.display()))?;
        }
        Command::Ls { recursive, long, directory, json, as_nix, file, path } => {
            if json && directory {
                return Err("'--directory' is useless with '--json'".into());
            }
            let (root, components) = open_listing(&file, &path, as_nix)?;
            let shown = match as_nix {
                // A NAR accessor's paths show as `«unknown»/…` in Nix 2.26 (`showPath`).
                NixVersion::V2_26 => format!("«unknown»/{}", components.join("/")),
                NixVersion::V2_8 => path.clone(),
            };
            let Some(node) = root.find(components.iter().copied()) else {
                if (as_nix, json) == (NixVersion::V2_8, true) {
                    // Nix 2.8's `listNar` has opened the JSON object when it finds nothing.
                    out.write_all(b"{}").and_then(|()| out.flush()).map_err(|e| e.to_string())?;
                    return Err(format!("path '{shown}' does not exist in NAR"));
                }
                return Err(format!("path '{shown}' does not exist"));
            };
            if json {
                let keys = match as_nix {
                    NixVersion::V2_26 => JsonKeys::Sorted,
                    NixVersion::V2_8 => JsonKeys::Nix2_8,
                };
                out.write_all(&node.to_json(recursive, keys)).map_err(|e| e.to_string())?;
                if as_nix == NixVersion::V2_26 {
                    out.write_all(b"\n").map_err(|e| e.to_string())?;
                }
            } else {
                // A directory is listed as `.`, anything else by its base name (`ls.cc`).
                let label = match node {
                    NarEntry::Directory { .. } => ".",
                    _ => components.last().copied().unwrap_or(""),
                };
                out.write_all(&node.to_text(label, TextOptions { long, recursive, directory })).map_err(|e| e.to_string())?;
            }
        }
    }
    out.flush().map_err(|e| e.to_string())?;
    Ok(ExitCode::SUCCESS)
}

/// The listing of the NAR `file` and the names below its root that `path` leads to
/// ([`ls_components`]).
fn open_listing<'a>(file: &std::path::Path, path: &'a str, as_nix: NixVersion) -> Result<(NarEntry, Vec<&'a str>), String> {
    let components = ls_components(path, as_nix)?;
    let f = std::fs::File::open(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let root = list_whole(std::io::BufReader::new(f)).map_err(|e| format!("{}: {e}", file.display()))?;
    Ok((root, components))
}

/// The names below a NAR's root that `path` leads to, as the Nix version reads it.
/// Nix 2.26 reads it as a `CanonPath` (`src/libutil/canon-path.cc`: relative to the root, empty
/// and `.` components dropped, `..` going up, never above the root). Nix 2.8 (`ls.cc`,
/// `NarAccessor::find` in `src/libstore/nar-accessor.cc`) takes `/` as the root, refuses a
/// relative path as `canonPath` does, and walks every other path as written, so that
/// `/share/`, `//share` and `/a/../share` name nothing.
fn ls_components(path: &str, as_nix: NixVersion) -> Result<Vec<&str>, String> {
    match as_nix {
        NixVersion::V2_26 => {
            let mut out = Vec::new();
            for c in path.split('/') {
                match c {
                    "" | "." => {}
                    ".." => {
                        out.pop();
                    }
                    name => out.push(name),
                }
            }
            Ok(out)
        }
        NixVersion::V2_8 => match path {
            "/" | "" => Ok(Vec::new()),
            p => p.strip_prefix('/').map(|rest| rest.split('/').collect()).ok_or_else(|| format!("not an absolute path: '{p}'")),
        },
    }
}
