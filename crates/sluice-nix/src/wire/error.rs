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

    /// Whether the peer simply went away (end of input while reading).
    pub fn is_eof(&self) -> bool {
        matches!(self, WireError::Io { source, .. } if source.kind() == std::io::ErrorKind::UnexpectedEof)
    }
}
