//! nixbase32: Nix's base-32 encoding (alphabet `0123456789abcdfghijklmnpqrsvwxyz`, least
//! significant 5-bit group printed last). Source: Nix `src/libutil/hash.cc` (`printHash32`).

/// Errors decoding nixbase32.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Base32Error {
    #[error("invalid nixbase32 character {0:?}")]
    InvalidChar(char),
    #[error("nixbase32 string of length {0} does not encode whole bytes")]
    InvalidLength(usize),
}

/// Length in characters of the nixbase32 encoding of `n` bytes.
pub fn encoded_len(n: usize) -> usize {
    todo!()
}

/// Encodes bytes in nixbase32.
pub fn encode(bytes: &[u8]) -> String {
    todo!()
}

/// Decodes a nixbase32 string; rejects invalid characters and non-zero high bits.
pub fn decode(s: &str) -> Result<Vec<u8>, Base32Error> {
    todo!()
}
