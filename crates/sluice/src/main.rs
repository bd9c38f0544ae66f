//! `sluice`: the command line. Thin: parses arguments, builds settings, calls the engines in
//! `sluice-store`, renders progress and results.

mod as_nix;
mod copy;
mod daemon;
mod key;
mod legacy_serve;
mod log;
mod manual;
mod missing;
mod nar;
mod path_info;
mod progress;
mod serve;
mod setup;
mod stderr;
mod store;
mod systemd;
mod terminal;

/// The allocator: jemalloc, whose per-thread caches take the buffers and path records that
/// one thread allocates and another frees (a NAR's chunks, unpacked on one thread and
/// registered on another) without glibc's arena locks; docs/benchmarks.md has the comparison
/// with glibc's malloc and mimalloc.
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options (its `malloc_conf`, read at its start; `_RJEM_MALLOC_CONF` in the
/// environment adds to them): pages freed are given back after 100 ms rather than jemalloc's
/// 10 s, which kept a network copy's download buffers resident; giving them back at once costs
/// CPU (docs/benchmarks.md).
#[allow(unsafe_code)] // the symbol jemalloc reads its options from
#[export_name = "_rjem_malloc_conf"]
static JEMALLOC_OPTIONS: &[u8; 19] = b"dirty_decay_ms:100\0";

use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

/// sluice: the store side of Nix — substituter, local store, daemon.
#[derive(Parser)]
#[command(name = "sluice", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    log: log::LogFlags,
}

#[derive(Subcommand)]
enum Command {
    /// Copy the closures of store paths from binary caches into a store (like `nix copy`).
    Copy(copy::Args),
    /// Show what would be fetched for store paths (like `nix build --dry-run`).
    Missing(missing::Args),
    /// Show metadata of store paths (like `nix path-info`).
    PathInfo(path_info::Args),
    /// Create, unpack and list NAR files.
    #[command(subcommand)]
    Nar(nar::Command),
    /// Serve Nix's worker protocol to real Nix clients (like `nix-daemon`).
    Daemon(daemon::Args),
    /// Serve Nix's serve protocol on stdin/stdout (like `nix-store --serve`; the far end of ssh://).
    LegacyServe(legacy_serve::Args),
    /// Serve a store over HTTP as a binary cache (like nix-serve or harmonia).
    Serve(serve::Args),
    /// Verify, sign and collect stores and binary caches.
    #[command(subcommand)]
    Store(store::Command),
    /// Generate and convert signing keys.
    #[command(subcommand)]
    Key(key::Command),
    /// Print the shell completion script for SHELL.
    Completions {
        /// The shell the script is for.
        shell: clap_complete::Shell,
    },
    /// Write man pages (sluice.1 and one per subcommand) into DIR.
    Man {
        /// The directory to write into (created if missing).
        dir: std::path::PathBuf,
    },
}

fn main() -> ExitCode {
    // A usage error exits with 1, as Nix's do (clap's own is 2); `--help` and `--version` with 0.
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() { ExitCode::FAILURE } else { ExitCode::SUCCESS };
        }
    };
    let log = log::Log::init(&cli.log);
    stderr::write_waiting_lines_on_panic();
    // sluice's own messages: warnings by default, more with -v (info) and -vv (debug); the
    // libraries' (HTTP, TLS) beyond warnings only at Nix's `vomit` level (-vvvv), where Nix
    // turns on curl's verbose output. `SLUICE_LOG` (an `EnvFilter`) wins.
    let filter = match log.verbosity {
        ..=log::LVL_INFO => "warn",
        4 => "warn,sluice=info",
        5 | 6 => "warn,sluice=debug",
        _ => "debug",
    };
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("SLUICE_LOG").unwrap_or_else(|_| filter.into()))
        .with_writer(log::TracingWriter)
        .with_ansi(log.format == log::LogFormat::Bar)
        .event_format(log::NixStyle)
        .init();
    if !matches!(cli.command, Command::Daemon(_) | Command::Copy(_) | Command::Serve(_) | Command::LegacyServe(_)) {
        // A command whose output is piped into `head` ends quietly when the reader goes away,
        // like other Unix tools, instead of panicking on the write. (The daemon keeps
        // ignoring SIGPIPE: a client that hangs up must not end it, and so does `serve`; so does `copy`: a server
        // that answers an upload and closes before reading its body must be an error of that
        // upload, not the end of the run.)
        // SAFETY: restoring the default disposition of a signal, before any thread starts.
        #[allow(unsafe_code)]
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    if let Some(limit) = raise_open_file_limit() {
        grow_descriptor_table(limit);
    }
    let result = match cli.command {
        Command::Copy(a) => copy::run(a),
        Command::Missing(a) => missing::run(a),
        Command::PathInfo(a) => path_info::run(a),
        Command::Nar(c) => nar::run(c),
        Command::Key(c) => key::run(c),
        Command::Store(c) => store::run(c),
        Command::Daemon(a) => daemon::run(a),
        Command::LegacyServe(a) => legacy_serve::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Completions { shell } => manual::completions(Cli::command(), shell),
        Command::Man { dir } => manual::man_pages(Cli::command(), &dir),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            log.error(&e);
            ExitCode::FAILURE
        }
    }
}

/// Descriptor numbers the process's descriptor table is grown to hold at start.
const DESCRIPTOR_TABLE: libc::c_int = 16384;

/// Grows the process's descriptor table, while it is the only thread, to hold the first
/// [`DESCRIPTOR_TABLE`] descriptors (at most `soft_limit`, the soft limit on open files): by duplicating standard error to
/// the highest of them and closing it again (the table never shrinks). Linux grows the table
/// when a descriptor above its size is opened, doubling it from 64 entries, and a process
/// with more than one thread waits in `synchronize_rcu()` each time (`expand_fdtable` in
/// `fs/file.c`) while every other thread that opens a file waits for it: a copy that holds
/// a thousand lock files grew it four times, each time stopping all its threads (measured in
/// docs/benchmarks.md). Grown here it costs 8 bytes and 2 bits per entry and no wait. Nothing to do if it fails.
#[allow(unsafe_code)]
fn grow_descriptor_table(soft_limit: libc::rlim_t) {
    let highest = soft_limit.min(DESCRIPTOR_TABLE as libc::rlim_t) as libc::c_int - 1;
    // SAFETY: dup2 and close act on a descriptor number nothing else uses (above every open
    // one, and no thread runs yet to open it).
    unsafe {
        if highest > 2 && libc::fcntl(highest, libc::F_GETFD) == -1 && libc::dup2(2, highest) == highest {
            libc::close(highest);
        }
    }
}

/// Raises the soft limit on open files to the hard limit. A copy holds a lock file per path it
/// has downloaded and yet to register, as many as its budget allows (`sluice_store::fd_budget`:
/// half the limit), and the daemon one socket per client: under the common soft limit of 1024
/// (hard limits are far higher) a 1056-path copy would run short of locks and download its
/// paths in dependency order, some of them twice. Returns the soft limit now; `None` if it
/// cannot be read.
#[allow(unsafe_code)]
fn raise_open_file_limit() -> Option<libc::rlim_t> {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed to them.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return None;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit { rlim_cur: limit.rlim_max, ..limit };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                return Some(raised.rlim_cur);
            }
        }
    }
    Some(limit.rlim_cur)
}
