//! The client's side of the stderr channel (`RemoteStore::processStderr` in Nix
//! `src/libstore/remote-store.cc`): the messages a daemon sends while an operation runs, up
//! to its `LAST` or `ERROR`.

use std::io::Read;

use super::primitives::{read_count, read_string, read_u64};
use super::stderr_tag as tag;
use super::{ActivityField, ProtocolVersion, WireError};

/// Longest log line or error message accepted, in bytes.
const MAX_TEXT: u64 = 1 << 20;
/// Most fields of one activity or result, and most traces of one error.
const MAX_ITEMS: u64 = 1 << 10;

/// One message of the stderr channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StderrMessage {
    /// `NEXT`: a log line.
    Next(String),
    /// `START_ACTIVITY`: id, level, type, text, fields, parent.
    StartActivity { id: u64, level: u64, activity_type: u64, text: String, fields: Vec<ActivityField>, parent: u64 },
    /// `STOP_ACTIVITY`.
    StopActivity(u64),
    /// `RESULT` of an activity: id, type, fields.
    Result { id: u64, result_type: u64, fields: Vec<ActivityField> },
    /// `LAST`: the operation succeeded; its result follows.
    Last,
    /// `ERROR`: the operation failed with this message (and, before 1.26, an exit status).
    Error(String),
}

/// Reads one stderr message as a client of `version` receives it. `READ` and `WRITE` (data
/// requests of import and export) are reported as invalid: a client that does not use those
/// operations never sees them.
pub fn read_stderr_message(r: &mut (impl Read + ?Sized), version: ProtocolVersion) -> Result<StderrMessage, WireError> {
    Ok(match read_u64(r, "stderr message tag")? {
        tag::NEXT => StderrMessage::Next(read_string(r, MAX_TEXT, "log line")?),
        tag::START_ACTIVITY => StderrMessage::StartActivity {
            id: read_u64(r, "activity id")?,
            level: read_u64(r, "activity level")?,
            activity_type: read_u64(r, "activity type")?,
            text: read_string(r, MAX_TEXT, "activity text")?,
            fields: read_fields(r)?,
            parent: read_u64(r, "parent activity")?,
        },
        tag::STOP_ACTIVITY => StderrMessage::StopActivity(read_u64(r, "activity id")?),
        tag::RESULT => {
            StderrMessage::Result { id: read_u64(r, "activity id")?, result_type: read_u64(r, "result type")?, fields: read_fields(r)? }
        }
        tag::LAST => StderrMessage::Last,
        tag::ERROR if version.at_least(26) => {
            read_string(r, 64, "error type")?;
            read_u64(r, "error level")?;
            read_string(r, MAX_TEXT, "error name")?;
            let message = read_string(r, MAX_TEXT, "error message")?;
            read_u64(r, "error position flag")?;
            for _ in 0..read_count(r, MAX_ITEMS, "error traces")? {
                read_u64(r, "trace position flag")?;
                read_string(r, MAX_TEXT, "trace")?;
            }
            StderrMessage::Error(message)
        }
        tag::ERROR => {
            let message = read_string(r, MAX_TEXT, "error message")?;
            read_u64(r, "error status")?;
            StderrMessage::Error(message)
        }
        other => return Err(WireError::invalid("stderr message tag", format!("{other:#x} is not a message this client expects"))),
    })
}

fn read_fields(r: &mut (impl Read + ?Sized)) -> Result<Vec<ActivityField>, WireError> {
    let n = read_count(r, MAX_ITEMS, "activity fields")?;
    (0..n)
        .map(|_| match read_u64(r, "field type")? {
            0 => Ok(ActivityField::Int(read_u64(r, "integer field")?)),
            1 => Ok(ActivityField::Str(read_string(r, MAX_TEXT, "string field")?)),
            t => Err(WireError::invalid("field type", format!("{t} (expected 0 or 1)"))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::StderrWriter;

    #[test]
    fn reads_what_the_daemon_writes() {
        for minor in [25, 34] {
            let version = ProtocolVersion::new(1, minor);
            let w = StderrWriter { version };
            let mut buf = Vec::new();
            w.next(&mut buf, "hello\n").unwrap();
            w.start_activity(&mut buf, 7, 3, 108, "fetching", &[ActivityField::Str("x".into()), ActivityField::Int(5)], 0).unwrap();
            w.result(&mut buf, 7, 105, &[ActivityField::Int(1)]).unwrap();
            w.stop_activity(&mut buf, 7).unwrap();
            w.error(&mut buf, "boom").unwrap();
            w.last(&mut buf).unwrap();
            let r = &mut buf.as_slice();
            let mut got = Vec::new();
            while !r.is_empty() {
                got.push(read_stderr_message(r, version).unwrap());
            }
            assert_eq!(
                got,
                vec![
                    StderrMessage::Next("hello\n".into()),
                    StderrMessage::StartActivity {
                        id: 7,
                        level: 3,
                        activity_type: 108,
                        text: "fetching".into(),
                        fields: vec![ActivityField::Str("x".into()), ActivityField::Int(5)],
                        parent: 0
                    },
                    StderrMessage::Result { id: 7, result_type: 105, fields: vec![ActivityField::Int(1)] },
                    StderrMessage::StopActivity(7),
                    StderrMessage::Error("boom".into()),
                    StderrMessage::Last,
                ]
            );
        }
        let mut bad = Vec::new();
        crate::wire::write_u64(&mut bad, 0x1234).unwrap();
        assert!(read_stderr_message(&mut bad.as_slice(), ProtocolVersion::new(1, 34)).unwrap_err().to_string().contains("0x1234"));
    }
}
