//! Streaming, strict NAR reader. Rejects: bad magic, unknown or misplaced tokens (`executable`
//! after `contents`, `name` after `node`), non-zero padding, truncation, entry names that are
//! empty, `.`, `..`, or contain `/` or NUL, and unsorted or duplicate directory entries.
//! Tokens other than file contents are bounded in length (no allocation by declared length).

/// Why a NAR was rejected, with the byte offset where it was noticed.
#[derive(Debug, thiserror::Error)]
pub enum NarError {
    #[error("NAR: unexpected end of input at byte {offset}")]
    Truncated { offset: u64 },
    #[error("NAR: {what} at byte {offset}")]
    Invalid { offset: u64, what: String },
    #[error("NAR: I/O error at byte {offset}: {source}")]
    Io { offset: u64, #[source] source: std::io::Error },
}

/// Parses one NAR from `reader`, calling `visitor` for each node, and returns the number of
/// bytes the NAR took. Reads exactly the NAR: no byte after its end is consumed. Errors from
/// the visitor are returned as [`NarError::Io`].
pub fn parse<R: std::io::Read, V: super::NarVisitor + ?Sized>(reader: R, visitor: &mut V) -> Result<u64, NarError> {
    todo!()
}
