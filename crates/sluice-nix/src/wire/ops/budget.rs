//! The byte budget of one request header: however its lists and strings are bounded one by
//! one, a request is read only up to [`Request::MAX_BYTES`] bytes in all. Nix's `daemon.cc`
//! reads without bound; a daemon that accepts untrusted users must not hold what one request
//! declares (a hundred thousand 1 MiB setting overrides, four million 4 KiB paths).

use std::io::{self, Read};

use super::Request;
use crate::store_path::StoreDir;
use crate::wire::{ProtocolVersion, WireError};

/// The most bytes a request header may take unless its request says otherwise: a closure of
/// a million store paths (about 90 bytes each on the wire: length, `/nix/store/`, hash, name,
/// padding) sent as one path list (QueryValidPaths, BuildPaths, CollectGarbage…), with room.
pub const MAX_REQUEST: u64 = 128 << 20;

/// Reads the header of request `R` (after its operation number) as [`Request::read`] does,
/// failing with [`WireError::RequestTooLarge`] once it takes more than `R::MAX_BYTES`.
pub fn read_request<R: Request>(r: &mut dyn Read, dir: &StoreDir, version: ProtocolVersion) -> Result<R, WireError> {
    let mut budgeted = Budgeted { inner: r, left: R::MAX_BYTES, exceeded: false };
    R::read(&mut budgeted, dir, version).map_err(|e| match e {
        WireError::Io { what, .. } if budgeted.exceeded => WireError::RequestTooLarge { request: R::OP.name(), max: R::MAX_BYTES, what },
        e => e,
    })
}

/// A reader that fails once more than `left` bytes are asked of it.
struct Budgeted<'r> {
    inner: &'r mut dyn Read,
    left: u64,
    exceeded: bool,
}

impl Read for Budgeted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.left == 0 {
            self.exceeded = true;
            return Err(io::Error::other("the request's byte budget is spent"));
        }
        let want = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let got = self.inner.read(&mut buf[..want])?;
        self.left -= got as u64;
        Ok(got)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::v;
    use super::super::SetOptions;
    use super::*;
    use crate::wire::{write_bytes, write_u64};

    /// SetOptions with `n` overrides of a `len`-byte value each.
    fn set_options(n: u64, len: usize) -> Vec<u8> {
        let mut buf = Vec::new();
        (0..12).for_each(|_| write_u64(&mut buf, 0).unwrap());
        write_u64(&mut buf, n).unwrap();
        for i in 0..n {
            write_bytes(&mut buf, format!("k{i}").as_bytes()).unwrap();
            write_bytes(&mut buf, &vec![b'v'; len]).unwrap();
        }
        buf
    }

    #[test]
    fn a_request_beyond_its_budget_is_refused_naming_it() {
        let dir = StoreDir::default();
        let within = set_options(3, 1 << 20);
        let read = read_request::<SetOptions>(&mut within.as_slice(), &dir, v(34)).unwrap();
        assert_eq!(read.overrides.len(), 3);
        let beyond = set_options(5, 1 << 20);
        let err = read_request::<SetOptions>(&mut beyond.as_slice(), &dir, v(34)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "SetOptions request refused: more than its limit of 4194304 bytes was sent (the limit was reached reading setting override)"
        );
    }
}
