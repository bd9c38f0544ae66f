//! nixbase32: Nix's base-32 encoding (alphabet `0123456789abcdfghijklmnpqrsvwxyz`, least
//! significant 5-bit group printed last). Source: Nix `src/libutil/hash.cc` (`printHash32`).
//!
//! The input is read as one little-endian number; the encoding prints its 5-bit groups from
//! the most significant down, so character `k` (from the left) holds bits
//! `5*(len-1-k) .. 5*(len-1-k)+5` of the number.

/// The 32 digits, in value order (no `e`, `o`, `u`, `t`).
pub const ALPHABET: &[u8; 32] = b"0123456789abcdfghijklmnpqrsvwxyz";

/// Errors decoding nixbase32.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Base32Error {
    #[error("invalid nixbase32 character {0:?}")]
    InvalidChar(char),
    #[error("nixbase32 string of length {0} does not encode whole bytes")]
    InvalidLength(usize),
}

/// Length in characters of the nixbase32 encoding of `n` bytes.
pub(crate) fn encoded_len(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        (n * 8 - 1) / 5 + 1
    }
}

/// The number of bytes a nixbase32 string of `len` characters decodes to, if `len` is the
/// length of some encoding.
pub(crate) fn decoded_len(len: usize) -> Option<usize> {
    let n = len * 5 / 8;
    (encoded_len(n) == len).then_some(n)
}

/// Digit values by byte; 0xff marks a byte that is not a nixbase32 digit.
const DIGIT_VALUES: [u8; 256] = {
    let mut table = [0xffu8; 256];
    let mut i = 0;
    while i < ALPHABET.len() {
        table[ALPHABET[i] as usize] = i as u8;
        i += 1;
    }
    table
};

/// The value of one nixbase32 digit.
fn digit_value(c: u8) -> Option<u8> {
    Some(DIGIT_VALUES[usize::from(c)]).filter(|v| *v != 0xff)
}

/// Encodes bytes in nixbase32.
pub fn encode(bytes: &[u8]) -> String {
    let len = encoded_len(bytes.len());
    let mut out = String::with_capacity(len);
    for n in (0..len).rev() {
        let b = n * 5;
        let (i, j) = (b / 8, b % 8);
        let lo = bytes.get(i).map_or(0, |&x| u16::from(x) >> j);
        let hi = bytes.get(i + 1).map_or(0, |&x| u16::from(x) << (8 - j));
        out.push(char::from(ALPHABET[usize::from((lo | hi) & 0x1f)]));
    }
    out
}

/// Whether every byte of `s` is a nixbase32 digit. For a store path's hash part (32 digits,
/// exactly 160 bits) that is all [`decode`] would check, without allocating.
pub fn is_digits(s: &str) -> bool {
    s.bytes().all(|c| digit_value(c).is_some())
}

/// Decodes a nixbase32 string; rejects invalid characters and non-zero high bits.
pub fn decode(s: &str) -> Result<Vec<u8>, Base32Error> {
    let n = decoded_len(s.len()).ok_or(Base32Error::InvalidLength(s.len()))?;
    let mut out = vec![0u8; n];
    for (k, c) in s.bytes().enumerate() {
        let d = digit_value(c)
            .ok_or_else(|| Base32Error::InvalidChar(s.get(k..).and_then(|t| t.chars().next()).unwrap_or(char::REPLACEMENT_CHARACTER)))?;
        let b = (s.len() - 1 - k) * 5;
        let (i, j) = (b / 8, b % 8);
        let wide = u16::from(d) << j;
        if let Some(x) = out.get_mut(i) {
            *x |= (wide & 0xff) as u8;
        }
        let carry = (wide >> 8) as u8;
        match out.get_mut(i + 1) {
            Some(x) => *x |= carry,
            None if carry != 0 => {
                return Err(Base32Error::InvalidChar(char::from(c)));
            }
            None => {}
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths() {
        assert_eq!(encoded_len(0), 0);
        assert_eq!(encoded_len(16), 26);
        assert_eq!(encoded_len(20), 32);
        assert_eq!(encoded_len(32), 52);
        assert_eq!(encoded_len(64), 103);
        assert_eq!(decoded_len(52), Some(32));
        assert_eq!(decoded_len(51), None);
    }

    #[test]
    fn known_vectors() {
        // sha256("") as Nix prints it.
        let empty = [
            0xe3, 0xb0, 0xc4, 0x42, 0x98, 0xfc, 0x1c, 0x14, 0x9a, 0xfb, 0xf4, 0xc8, 0x99, 0x6f, 0xb9, 0x24, 0x27, 0xae, 0x41, 0xe4, 0x64,
            0x9b, 0x93, 0x4c, 0xa4, 0x95, 0x99, 0x1b, 0x78, 0x52, 0xb8, 0x55,
        ];
        let s = "0mdqa9w1p6cmli6976v4wi0sw9r4p5prkj7lzfd1877wk11c9c73";
        assert_eq!(encode(&empty), s);
        assert_eq!(decode(s).unwrap(), empty);
        assert_eq!(encode(&[]), "");
        assert_eq!(encode(&[0x1f]), "0z");
    }

    #[test]
    fn rejects() {
        assert_eq!(decode("e0"), Err(Base32Error::InvalidChar('e')));
        assert_eq!(decode("abc"), Err(Base32Error::InvalidLength(3)));
        // "z0" would need 10 bits for one byte: the high bits are set.
        assert!(matches!(decode("z0"), Err(Base32Error::InvalidChar(_))));
        assert!(decode("é0").is_err());
    }

    #[test]
    fn round_trip() {
        for n in 0..70usize {
            let bytes: Vec<u8> = (0..n).map(|i| (i * 37 + 11) as u8).collect();
            assert_eq!(decode(&encode(&bytes)).unwrap(), bytes);
        }
    }
}
