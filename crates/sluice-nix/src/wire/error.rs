//! Errors reading the worker protocol.

/// Why a worker-protocol message could not be read. Each variant names the field.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The peer closed the connection or an I/O error occurred while reading `what`.
    #[error("reading {what}: {source}")]
    Io {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// A length or count above the bound for this field.
    #[error("{what} is {len} long, more than the maximum of {max}")]
    TooLong { what: &'static str, len: u64, max: u64 },
    /// A request header that took more than its byte budget (`ops::read_request`); `what` is
    /// the field being read when the budget ran out.
    #[error("{request} request refused: more than its limit of {max} bytes was sent (the limit was reached reading {what})")]
    RequestTooLarge { request: &'static str, max: u64, what: &'static str },
    /// A string's padding bytes are not all zero.
    #[error("{what}: non-zero padding after a string")]
    NonZeroPadding { what: &'static str },
    /// A field's value is not acceptable (not UTF-8, not a store path, unknown enum value…).
    #[error("invalid {what}: {why}")]
    Invalid { what: &'static str, why: String },
}

impl WireError {
    /// An [`WireError::Invalid`] for `what`.
    pub fn invalid(what: &'static str, why: impl std::fmt::Display) -> Self {
        WireError::Invalid { what, why: why.to_string() }
    }

    /// Whether reading timed out (a socket's read timeout expired).
    pub fn is_timeout(&self) -> bool {
        matches!(self, WireError::Io { source, .. } if matches!(source.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
    }

    /// Whether the peer simply went away (end of input while reading).
    pub fn is_eof(&self) -> bool {
        matches!(self, WireError::Io { source, .. } if source.kind() == std::io::ErrorKind::UnexpectedEof)
    }
}
