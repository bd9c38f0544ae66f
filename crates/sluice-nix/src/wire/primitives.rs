//! Integers, booleans, strings and string lists (`src/libutil/serialise.{hh,cc}`: `readNum`,
//! `readString`, `readStrings`, `writeString`).

use std::io::{Read, Write};

use super::WireError;

/// Reads one u64 little-endian; `what` names the field for errors.
pub fn read_u64(r: &mut (impl Read + ?Sized), what: &'static str) -> Result<u64, WireError> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b).map_err(|source| WireError::Io { what, source })?;
    Ok(u64::from_le_bytes(b))
}

/// Reads a boolean: a u64 where any non-zero value is true (as Nix's `readInt` into `bool`).
pub fn read_bool(r: &mut (impl Read + ?Sized), what: &'static str) -> Result<bool, WireError> {
    Ok(read_u64(r, what)? != 0)
}

/// Writes one u64 little-endian.
pub fn write_u64(w: &mut (impl Write + ?Sized), n: u64) -> std::io::Result<()> {
    w.write_all(&n.to_le_bytes())
}

/// Writes a boolean as u64 0 or 1.
pub fn write_bool(w: &mut (impl Write + ?Sized), b: bool) -> std::io::Result<()> {
    write_u64(w, u64::from(b))
}

/// Reads a length-prefixed, zero-padded byte string of at most `max` bytes. Memory grows
/// with the bytes actually received, never with the declared length.
pub fn read_bytes(r: &mut (impl Read + ?Sized), max: u64, what: &'static str) -> Result<Vec<u8>, WireError> {
    let len = read_u64(r, what)?;
    if len > max {
        return Err(WireError::TooLong { what, len, max });
    }
    let mut buf = Vec::with_capacity(len.min(64 * 1024) as usize);
    let got = r.take(len).read_to_end(&mut buf).map_err(|source| WireError::Io { what, source })?;
    if got as u64 != len {
        let source = std::io::Error::new(std::io::ErrorKind::UnexpectedEof, format!("end of input after {got} of {len} bytes"));
        return Err(WireError::Io { what, source });
    }
    let mut pad = [0u8; 8];
    let pad = &mut pad[..padding(len)];
    r.read_exact(pad).map_err(|source| WireError::Io { what, source })?;
    if pad.iter().any(|&b| b != 0) {
        return Err(WireError::NonZeroPadding { what });
    }
    Ok(buf)
}

/// Reads a string of at most `max` bytes that must be UTF-8.
pub fn read_string(r: &mut (impl Read + ?Sized), max: u64, what: &'static str) -> Result<String, WireError> {
    String::from_utf8(read_bytes(r, max, what)?).map_err(|_| WireError::invalid(what, "not valid UTF-8"))
}

/// Reads a list of at most `max_count` strings of at most `max_len` bytes each.
pub fn read_strings(r: &mut (impl Read + ?Sized), max_count: u64, max_len: u64, what: &'static str) -> Result<Vec<String>, WireError> {
    let n = read_count(r, max_count, what)?;
    let mut out = Vec::with_capacity(n.min(1024) as usize);
    for _ in 0..n {
        out.push(read_string(r, max_len, what)?);
    }
    Ok(out)
}

/// Reads a map written as a count and (key, value) string pairs (`StringMap`).
pub fn read_string_pairs(
    r: &mut (impl Read + ?Sized),
    max_count: u64,
    max_len: u64,
    what: &'static str,
) -> Result<Vec<(String, String)>, WireError> {
    let n = read_count(r, max_count, what)?;
    let mut out = Vec::with_capacity(n.min(1024) as usize);
    for _ in 0..n {
        let k = read_string(r, max_len, what)?;
        out.push((k, read_string(r, max_len, what)?));
    }
    Ok(out)
}

/// Reads an element count bounded by `max`.
pub(crate) fn read_count(r: &mut (impl Read + ?Sized), max: u64, what: &'static str) -> Result<u64, WireError> {
    let n = read_u64(r, what)?;
    if n > max {
        return Err(WireError::TooLong { what, len: n, max });
    }
    Ok(n)
}

/// Writes a length-prefixed byte string with zero padding.
pub fn write_bytes(w: &mut (impl Write + ?Sized), b: &[u8]) -> std::io::Result<()> {
    write_bytes_joined(w, &[b])
}

/// Writes the concatenation of `parts` as one string (length, bytes, padding), without
/// making it first: e.g. a store path as its directory, `/` and base name.
pub fn write_bytes_joined(w: &mut (impl Write + ?Sized), parts: &[&[u8]]) -> std::io::Result<()> {
    let len = parts.iter().map(|p| p.len() as u64).sum();
    write_u64(w, len)?;
    for p in parts {
        w.write_all(p)?;
    }
    w.write_all(&[0u8; 8][..padding(len)])
}

/// Writes a count and then each string.
pub fn write_strings<S: AsRef<[u8]>>(w: &mut (impl Write + ?Sized), items: impl ExactSizeIterator<Item = S>) -> std::io::Result<()> {
    write_u64(w, items.len() as u64)?;
    for s in items {
        write_bytes(w, s.as_ref())?;
    }
    Ok(())
}

/// Writes a count and (key, value) string pairs.
pub fn write_string_pairs<K: AsRef<[u8]>, V: AsRef<[u8]>>(
    w: &mut (impl Write + ?Sized),
    items: impl ExactSizeIterator<Item = (K, V)>,
) -> std::io::Result<()> {
    write_u64(w, items.len() as u64)?;
    for (k, v) in items {
        write_bytes(w, k.as_ref())?;
        write_bytes(w, v.as_ref())?;
    }
    Ok(())
}

/// Zero bytes that follow a string of `len` bytes.
fn padding(len: u64) -> usize {
    ((8 - len % 8) % 8) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_bounds() {
        let mut buf = Vec::new();
        write_bytes(&mut buf, b"hello").unwrap();
        assert_eq!(buf.len(), 16);
        assert_eq!(read_string(&mut buf.as_slice(), 5, "s").unwrap(), "hello");
        assert!(matches!(read_string(&mut buf.as_slice(), 4, "s"), Err(WireError::TooLong { len: 5, max: 4, .. })));
        buf[15] = 1;
        assert!(matches!(read_string(&mut buf.as_slice(), 5, "s"), Err(WireError::NonZeroPadding { .. })));
    }

    #[test]
    fn huge_declared_length_takes_no_memory() {
        let mut buf = Vec::new();
        write_u64(&mut buf, u64::MAX / 2).unwrap();
        buf.extend_from_slice(b"abc");
        let err = read_bytes(&mut buf.as_slice(), u64::MAX, "blob").unwrap_err();
        assert!(err.is_eof() && err.to_string().contains("after 3 of"), "{err}");
        let mut list = Vec::new();
        write_u64(&mut list, 1 << 40).unwrap();
        assert!(matches!(read_strings(&mut list.as_slice(), 1000, 10, "list"), Err(WireError::TooLong { .. })));
    }
}
