//! Logging as Nix does it (`src/libutil/logging.cc`, `logging.hh`): a verbosity (`-v`,
//! `--quiet`), and a format: `bar` (a live progress line, on a terminal), `raw` (lines of text,
//! e.g. `copying path 'X' from 'URL'...`) or `internal-json` (Nix's `@nix {…}` lines: activities
//! started and stopped, their results, messages), which nix-output-monitor reads.
//!
//! The JSON lines have Nix 2.26's shape (`JSONLogger`, `logging.cc`): keys sorted as
//! nlohmann's `json.dump` writes them, `parent` in every `start`, `fields` only when there are
//! any, an error's `msg` with its `raw_msg` (the text without `error: `) and null
//! `column`/`file`/`line`. Nix 2.8's lines are the same less `parent` and the copy's results;
//! parsers of either read both.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use serde_json::json;

use crate::terminal::for_stderr;

/// Nix's `Verbosity` (`logging.hh`): 0 error, 1 warn, 2 notice, 3 info (the default),
/// 4 talkative, 5 chatty, 6 debug, 7 vomit.
pub type Verbosity = u8;
/// `lvlError`.
pub const LVL_ERROR: Verbosity = 0;
/// `lvlWarn`.
pub const LVL_WARN: Verbosity = 1;
/// `lvlNotice`.
pub const LVL_NOTICE: Verbosity = 2;
/// `lvlInfo`: Nix's default verbosity, and the level of `copying path …` activities.
pub const LVL_INFO: Verbosity = 3;

/// Nix's activity types (`ActivityType`, `logging.hh`).
pub mod act {
    /// `actCopyPath`: fields `[path, from URL, to URL]` (a local store's URL is `local`).
    pub const COPY_PATH: u64 = 100;
    /// `actCopyPaths`: the whole copy; its progress counts paths.
    pub const COPY_PATHS: u64 = 103;
}

/// Nix's result types (`ResultType`, `logging.hh`).
pub mod res {
    /// `resProgress`: fields `[done, expected, running, failed]`.
    pub const PROGRESS: u64 = 105;
    /// `resSetExpected`: fields `[activity type, expected]`.
    pub const SET_EXPECTED: u64 = 106;
}

/// How log output looks (`--log-format`, as Nix's `LogFormat`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogFormat {
    /// Lines of text, as Nix prints them with its output piped.
    Raw,
    /// Nix's `@nix {…}` JSON lines.
    InternalJson,
    /// A progress line that redraws itself, for `copy` and `missing` (only on a terminal; raw
    /// lines otherwise, and for the commands without progress).
    Bar,
}

/// The logging flags every command takes.
#[derive(clap::Args, Debug, Clone)]
pub struct LogFlags {
    /// More output: `-v` for each level above Nix's default (info); `-vv` also shows debug
    /// messages of sluice, `-vvvv` those of its HTTP and TLS libraries too. Verbose output
    /// prints lines instead of the progress line.
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Less output: errors and warnings only, no progress.
    #[arg(long, global = true)]
    pub quiet: bool,
    /// How log output looks [default: `bar` on a terminal without `-v`, `raw` otherwise].
    #[arg(long, value_enum, global = true)]
    pub log_format: Option<LogFormat>,
}

/// The logging settings of this run.
#[derive(Debug, Clone, Copy)]
pub struct Log {
    pub verbosity: Verbosity,
    pub format: LogFormat,
}

static LOG: OnceLock<Log> = OnceLock::new();
/// Activity ids: the process id in the upper 32 bits, as Nix's `nextId`.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

impl Log {
    /// Sets the run's settings from the flags (once, at start).
    pub fn init(flags: &LogFlags) -> Log {
        let verbosity = if flags.quiet { LVL_WARN } else { (LVL_INFO + flags.verbose).min(7) };
        let format = match flags.log_format {
            Some(LogFormat::InternalJson) => LogFormat::InternalJson,
            Some(LogFormat::Raw) => LogFormat::Raw,
            // The bar only on a terminal, and not with verbose output (lines would scroll it away).
            _ if !std::io::stderr().is_terminal() || flags.verbose > 0 => LogFormat::Raw,
            _ => LogFormat::Bar,
        };
        NEXT_ID.store(u64::from(std::process::id()) << 32, Ordering::Relaxed);
        *LOG.get_or_init(|| Log { verbosity, format })
    }

    /// This run's settings (Nix's defaults before [`Log::init`]).
    pub fn get() -> Log {
        *LOG.get().unwrap_or(&Log { verbosity: LVL_INFO, format: LogFormat::Raw })
    }

    /// Whether the live progress line is drawn.
    pub fn bar(&self) -> bool {
        self.format == LogFormat::Bar && self.verbosity >= LVL_INFO
    }

    /// Prints `text` at `level` if the verbosity shows it: a line on standard error, or a
    /// `msg` entry in JSON.
    pub fn msg(&self, level: Verbosity, text: &str) {
        if level > self.verbosity {
            return;
        }
        match self.format {
            LogFormat::InternalJson => emit(json!({"action": "msg", "level": level, "msg": text})),
            _ => crate::stderr::write(format!("{}\n", for_stderr(text)).as_bytes()),
        }
    }

    /// Prints the error `what` as Nix's `logError` does: `error: WHAT`, or in JSON a `msg` at
    /// level 0 with `raw_msg` and no position (Nix's `JSONLogger::logEI`).
    pub fn error(&self, what: &str) {
        match self.format {
            LogFormat::InternalJson => emit(json!({
                "action": "msg", "column": null, "file": null, "level": LVL_ERROR, "line": null,
                "msg": format!("error: {what}"), "raw_msg": what,
            })),
            _ => crate::stderr::write(format!("error: {}\n", for_stderr(what)).as_bytes()),
        }
    }
}

/// Writes one `@nix {…}` line to standard error, whole.
fn emit(value: serde_json::Value) {
    crate::stderr::write(format!("@nix {value}\n").as_bytes());
}

/// Adds `fields` to a JSON line in the key order of Nix's (sorted: `fields` after `action`),
/// leaving an empty array out as Nix's `addFields` does.
fn add_fields(line: &mut serde_json::Value, fields: serde_json::Value) {
    let Some(object) = line.as_object_mut() else { return };
    if fields.as_array().is_some_and(|f| !f.is_empty()) {
        object.insert("fields".into(), fields);
        object.sort_keys();
    }
}

/// A started activity (Nix's `Activity`): its `stop` line is written when it is dropped.
/// Writes nothing unless the format is `internal-json` (other formats render activities
/// themselves).
pub struct Activity {
    id: u64,
    json: bool,
}

impl Activity {
    /// Starts an activity of type `kind` (an [`act`] constant) at `level`, with `text` and
    /// `fields` (none: `[]`), under `parent` (0 for none).
    pub fn start(level: Verbosity, kind: u64, text: &str, fields: serde_json::Value, parent: u64) -> Activity {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed) + 1;
        let json = Log::get().format == LogFormat::InternalJson;
        if json {
            let mut line = json!({"action": "start", "id": id, "level": level, "parent": parent, "text": text, "type": kind});
            add_fields(&mut line, fields);
            emit(line);
        }
        Activity { id, json }
    }

    /// A result of type `kind` (a [`res`] constant) with `fields`.
    pub fn result(&self, kind: u64, fields: serde_json::Value) {
        if self.json {
            let mut line = json!({"action": "result", "id": self.id, "type": kind});
            add_fields(&mut line, fields);
            emit(line);
        }
    }

    /// `resProgress`: `done` of `expected`, `running`, `failed`.
    pub fn progress(&self, done: u64, expected: u64, running: u64, failed: u64) {
        self.result(res::PROGRESS, json!([done, expected, running, failed]));
    }
}

impl Drop for Activity {
    fn drop(&mut self) {
        if self.json {
            emit(json!({"action": "stop", "id": self.id}));
        }
    }
}

/// How a `tracing` event reads: a warning or an error with Nix's `warning: ` and `error: `
/// (`logging.cc` `logWarning`, `printError`), so that sluice's own lines and its libraries'
/// read alike; the diagnostic levels keep their names (`DEBUG request …`).
pub struct NixStyle;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for NixStyle
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        match *event.metadata().level() {
            tracing::Level::ERROR => write!(writer, "error: ")?,
            tracing::Level::WARN => write!(writer, "warning: ")?,
            level => write!(writer, "{level} ")?,
        }
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// Where `tracing` events go: standard error, or in JSON a `msg` entry each (Nix's
/// `JSONLogger::log`), with Nix's level for the event's.
pub struct TracingWriter;

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for TracingWriter {
    type Writer = EventWriter;

    fn make_writer(&'a self) -> EventWriter {
        EventWriter { level: LVL_NOTICE, buf: Vec::new() }
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> EventWriter {
        let level = match *meta.level() {
            tracing::Level::ERROR => LVL_ERROR,
            tracing::Level::WARN => LVL_WARN,
            tracing::Level::INFO => LVL_INFO,
            tracing::Level::DEBUG => 6,
            tracing::Level::TRACE => 7,
        };
        EventWriter { level, buf: Vec::new() }
    }
}

/// One formatted `tracing` event, written out when dropped.
pub struct EventWriter {
    level: Verbosity,
    buf: Vec<u8>,
}

impl Write for EventWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        let text = String::from_utf8_lossy(&self.buf);
        match Log::get().format {
            LogFormat::InternalJson => emit(json!({"action": "msg", "level": self.level, "msg": text.trim_end()})),
            _ => crate::stderr::write(for_stderr(&text).as_bytes()),
        }
    }
}
