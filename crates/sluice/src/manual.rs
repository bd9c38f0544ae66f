//! `sluice completions SHELL` and `sluice man DIR`: shell completions and man pages, generated
//! from the command line's own clap definitions (so they cannot drift from `--help`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// Writes the completion script for `shell` to standard output.
pub fn completions(mut cmd: clap::Command, shell: clap_complete::Shell) -> Result<ExitCode, String> {
    clap_complete::generate(shell, &mut cmd, "sluice", &mut std::io::stdout());
    Ok(ExitCode::SUCCESS)
}

/// Writes `sluice.1` and a page per subcommand (`sluice-copy.1`, `sluice-nar-ls.1`, …) into
/// `dir`, which is created if missing; prints the paths written.
pub fn man_pages(cmd: clap::Command, dir: &Path) -> Result<ExitCode, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let mut cmd = cmd;
    cmd.build();
    for file in write_pages(&cmd, dir)? {
        println!("{}", file.display());
    }
    Ok(ExitCode::SUCCESS)
}

/// `page` with the help's Markdown code spans (`` `--store` ``) in bold, as man pages show
/// literal text; a backtick without its pair on the line stays.
fn roff_code(page: &str) -> String {
    page.lines()
        .map(|line| {
            let parts: Vec<&str> = line.split('`').collect();
            let paired = parts.len() - (parts.len() + 1) % 2;
            let mut out = String::new();
            for (i, part) in parts.iter().enumerate() {
                match i {
                    0 => {}
                    _ if i < paired => out.push_str(if i % 2 == 1 { "\\fB" } else { "\\fR" }),
                    _ => out.push('`'),
                }
                out.push_str(part);
            }
            out + "\n"
        })
        .collect()
}

/// The page of `cmd` and those of its subcommands, recursively, each named by its display
/// name (`sluice-nar-ls`, which clap gives a subcommand once the command is built).
fn write_pages(cmd: &clap::Command, dir: &Path) -> Result<Vec<PathBuf>, String> {
    let name = cmd.get_display_name().unwrap_or(cmd.get_name());
    let file = dir.join(format!("{name}.1"));
    let mut page = Vec::new();
    clap_mangen::Man::new(cmd.clone()).render(&mut page).map_err(|e| e.to_string())?;
    std::fs::write(&file, roff_code(&String::from_utf8_lossy(&page))).map_err(|e| format!("writing {}: {e}", file.display()))?;
    let mut written = vec![file];
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        written.extend(write_pages(sub, dir)?);
    }
    Ok(written)
}
