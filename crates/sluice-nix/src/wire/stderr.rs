//! The daemon → client stderr channel (`TunnelLogger` in `src/libstore/daemon.cc`, the error
//! encoding of `operator<<(Sink &, const Error &)` in `src/libutil/serialise.cc`): log lines,
//! activities and results, and each operation's final `LAST` or `ERROR`.

use std::io::{self, Write};

use super::primitives::{write_bytes, write_u64};
use super::stderr_tag as tag;
use super::{ProtocolVersion, StderrMessage};

/// One field of an activity or result: u64 0 then an integer, or u64 1 then a string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ActivityField {
    Int(u64),
    Str(String),
}

/// Writes stderr messages in the form a client of the negotiated `version` reads.
#[derive(Debug, Clone, Copy)]
pub struct StderrWriter {
    pub version: ProtocolVersion,
}

impl StderrWriter {
    /// `NEXT` with a log line (`text` should end in a newline, as Nix's do).
    pub fn next(&self, w: &mut dyn Write, text: &str) -> io::Result<()> {
        write_u64(w, tag::NEXT)?;
        write_bytes(w, text.as_bytes())
    }

    /// `START_ACTIVITY` (protocol ≥ 1.20); older clients get the text as a `NEXT` line with
    /// `...` appended, or nothing for an empty text. `level` is Nix's verbosity (0 = error),
    /// `activity_type` Nix's `ActivityType` (e.g. 100 = copyPath, 108 = substitute).
    #[allow(clippy::too_many_arguments)]
    pub fn start_activity(
        &self,
        w: &mut dyn Write,
        id: u64,
        level: u64,
        activity_type: u64,
        text: &str,
        fields: &[ActivityField],
        parent: u64,
    ) -> io::Result<()> {
        if !self.version.at_least(20) {
            return if text.is_empty() { Ok(()) } else { self.next(w, &format!("{text}...\n")) };
        }
        write_u64(w, tag::START_ACTIVITY)?;
        write_u64(w, id)?;
        write_u64(w, level)?;
        write_u64(w, activity_type)?;
        write_bytes(w, text.as_bytes())?;
        write_fields(w, fields)?;
        write_u64(w, parent)
    }

    /// `STOP_ACTIVITY` (protocol ≥ 1.20; nothing for older clients).
    pub fn stop_activity(&self, w: &mut dyn Write, id: u64) -> io::Result<()> {
        if !self.version.at_least(20) {
            return Ok(());
        }
        write_u64(w, tag::STOP_ACTIVITY)?;
        write_u64(w, id)
    }

    /// `RESULT` of an activity (protocol ≥ 1.20; nothing for older clients); `result_type` is
    /// Nix's `ResultType` (e.g. 105 = progress).
    pub fn result(&self, w: &mut dyn Write, id: u64, result_type: u64, fields: &[ActivityField]) -> io::Result<()> {
        if !self.version.at_least(20) {
            return Ok(());
        }
        write_u64(w, tag::RESULT)?;
        write_u64(w, id)?;
        write_u64(w, result_type)?;
        write_fields(w, fields)
    }

    /// Writes `msg`, read from another daemon ([`read_stderr_message`](super::read_stderr_message)),
    /// in this writer's version: what a daemon relaying an operation to another one sends its
    /// own client (log lines, activities and results as they come).
    pub fn forward(&self, w: &mut dyn Write, msg: &StderrMessage) -> io::Result<()> {
        match msg {
            StderrMessage::Next(text) => self.next(w, text),
            StderrMessage::StartActivity { id, level, activity_type, text, fields, parent } => {
                self.start_activity(w, *id, *level, *activity_type, text, fields, *parent)
            }
            StderrMessage::StopActivity(id) => self.stop_activity(w, *id),
            StderrMessage::Result { id, result_type, fields } => self.result(w, *id, *result_type, fields),
            StderrMessage::Last => self.last(w),
            StderrMessage::Error(message) => self.error(w, message),
        }
    }

    /// `LAST`: the operation succeeded and its result follows.
    pub fn last(&self, w: &mut dyn Write) -> io::Result<()> {
        write_u64(w, tag::LAST)
    }

    /// `ERROR` with `msg`. Protocol ≥ 1.26: type `"Error"`, level 0, name `"Error"`, the
    /// message, no position, no traces; older: the message and exit status 1.
    pub fn error(&self, w: &mut dyn Write, msg: &str) -> io::Result<()> {
        write_u64(w, tag::ERROR)?;
        if self.version.at_least(26) {
            write_bytes(w, b"Error")?;
            write_u64(w, 0)?;
            write_bytes(w, b"Error")?;
            write_bytes(w, msg.as_bytes())?;
            write_u64(w, 0)?;
            write_u64(w, 0)
        } else {
            write_bytes(w, msg.as_bytes())?;
            write_u64(w, 1)
        }
    }
}

fn write_fields(w: &mut dyn Write, fields: &[ActivityField]) -> io::Result<()> {
    write_u64(w, fields.len() as u64)?;
    for f in fields {
        match f {
            ActivityField::Int(n) => {
                write_u64(w, 0)?;
                write_u64(w, *n)?;
            }
            ActivityField::Str(s) => {
                write_u64(w, 1)?;
                write_bytes(w, s.as_bytes())?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_forms() {
        let mut new = Vec::new();
        StderrWriter { version: ProtocolVersion::new(1, 34) }.error(&mut new, "boom").unwrap();
        assert_eq!(new.len(), 8 + 16 + 8 + 16 + 16 + 8 + 8);
        let mut old = Vec::new();
        StderrWriter { version: ProtocolVersion::new(1, 25) }.error(&mut old, "boom").unwrap();
        assert_eq!(old.len(), 8 + 16 + 8);
        let mut act = Vec::new();
        StderrWriter { version: ProtocolVersion::new(1, 19) }.start_activity(&mut act, 1, 0, 108, "", &[], 0).unwrap();
        assert!(act.is_empty());
    }
}
