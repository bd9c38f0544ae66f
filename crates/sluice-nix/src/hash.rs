//! Hashes as Nix prints them: `algo:base16`, `algo:nixbase32`, `algo:base64` and SRI
//! (`algo-base64`). Source: Nix `src/libutil/hash.cc`.

use base64::Engine as _;
use sha2::Digest as _;

use crate::base32;
use crate::quoted::Quoted;

/// A hash algorithm Nix knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HashAlgo {
    Md5,
    Sha1,
    Sha256,
    Sha512,
}

/// A hash: algorithm and digest (16, 20, 32 or 64 bytes).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Hash {
    algo: HashAlgo,
    digest: Vec<u8>,
}

/// Errors parsing a hash.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HashError {
    #[error("unknown hash algorithm {}", Quoted(.0))]
    UnknownAlgo(String),
    #[error("hash {} has no algorithm prefix", Quoted(.0))]
    MissingAlgo(String),
    #[error("hash {} is not valid base16, nixbase32 or base64 for {algo}", Quoted(.hash))]
    BadEncoding { hash: String, algo: &'static str },
}

impl HashAlgo {
    /// Nix's name: `md5`, `sha1`, `sha256`, `sha512`.
    pub fn name(self) -> &'static str {
        match self {
            HashAlgo::Md5 => "md5",
            HashAlgo::Sha1 => "sha1",
            HashAlgo::Sha256 => "sha256",
            HashAlgo::Sha512 => "sha512",
        }
    }
    /// Digest length in bytes.
    pub(crate) fn digest_len(self) -> usize {
        match self {
            HashAlgo::Md5 => 16,
            HashAlgo::Sha1 => 20,
            HashAlgo::Sha256 => 32,
            HashAlgo::Sha512 => 64,
        }
    }
    /// Parses Nix's name.
    pub fn parse(s: &str) -> Result<Self, HashError> {
        match s {
            "md5" => Ok(HashAlgo::Md5),
            "sha1" => Ok(HashAlgo::Sha1),
            "sha256" => Ok(HashAlgo::Sha256),
            "sha512" => Ok(HashAlgo::Sha512),
            _ => Err(HashError::UnknownAlgo(s.to_owned())),
        }
    }
}

impl std::fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Decodes lowercase or uppercase base16.
fn decode_base16(s: &str) -> Option<Vec<u8>> {
    let pairs = s.as_bytes().chunks_exact(2);
    if !pairs.remainder().is_empty() {
        return None;
    }
    pairs
        .map(|pair| {
            let hi = char::from(pair[0]).to_digit(16)?;
            let lo = char::from(pair[1]).to_digit(16)?;
            Some((hi * 16 + lo) as u8)
        })
        .collect()
}

fn encode_base16(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(char::from(HEX[usize::from(b >> 4)]));
        s.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    s
}

/// Length of the padded base64 encoding of `n` bytes.
fn base64_len(n: usize) -> usize {
    n.div_ceil(3) * 4
}

impl Hash {
    /// Builds a hash from a digest of the right length for `algo`.
    pub fn new(algo: HashAlgo, digest: &[u8]) -> Option<Self> {
        (digest.len() == algo.digest_len()).then(|| Hash { algo, digest: digest.to_vec() })
    }
    /// The algorithm.
    pub fn algo(&self) -> HashAlgo {
        self.algo
    }
    /// The raw digest bytes.
    pub fn digest(&self) -> &[u8] {
        &self.digest
    }

    /// Parses `algo:<base16|nixbase32|base64>` or SRI `algo-<base64>`.
    pub fn parse(s: &str) -> Result<Self, HashError> {
        if let Some((algo, rest)) = s.split_once(':') {
            Self::parse_bare(rest, HashAlgo::parse(algo)?)
        } else if let Some((algo, rest)) = s.split_once('-') {
            Self::parse_sri_body(rest, HashAlgo::parse(algo)?)
        } else {
            Err(HashError::MissingAlgo(s.to_owned()))
        }
    }

    /// Parses SRI `algo-<base64>` only (as `nix path-info --json` prints).
    pub fn parse_sri(s: &str) -> Result<Self, HashError> {
        let (algo, rest) = s.split_once('-').ok_or_else(|| HashError::MissingAlgo(s.to_owned()))?;
        Self::parse_sri_body(rest, HashAlgo::parse(algo)?)
    }

    fn parse_sri_body(rest: &str, algo: HashAlgo) -> Result<Self, HashError> {
        if rest.len() != base64_len(algo.digest_len()) {
            return Err(Self::bad(rest, algo));
        }
        Self::parse_bare(rest, algo)
    }

    fn bad(s: &str, algo: HashAlgo) -> HashError {
        HashError::BadEncoding { hash: s.to_owned(), algo: algo.name() }
    }

    /// Parses a digest without prefix in base16, nixbase32 or base64 (told apart by length).
    pub(crate) fn parse_bare(s: &str, algo: HashAlgo) -> Result<Self, HashError> {
        let n = algo.digest_len();
        let digest = if s.len() == 2 * n {
            decode_base16(s)
        } else if s.len() == base32::encoded_len(n) {
            base32::decode(s).ok()
        } else if s.len() == base64_len(n) {
            base64::engine::general_purpose::STANDARD.decode(s).ok()
        } else {
            None
        };
        digest.and_then(|d| Hash::new(algo, &d)).ok_or_else(|| Self::bad(s, algo))
    }
    /// `sha256:<nixbase32>`, as in narinfo files.
    pub fn to_nix32_prefixed(&self) -> String {
        format!("{}:{}", self.algo, self.to_nix32())
    }
    /// `sha256:<base16>`, as in Nix's database (ValidPaths.hash).
    pub fn to_base16_prefixed(&self) -> String {
        format!("{}:{}", self.algo, self.to_base16())
    }
    /// `sha256-<base64>`, as in `nix path-info --json`.
    pub fn to_sri(&self) -> String {
        format!("{}-{}", self.algo, base64::engine::general_purpose::STANDARD.encode(&self.digest))
    }
    /// Bare lowercase base16 digest.
    pub fn to_base16(&self) -> String {
        encode_base16(&self.digest)
    }
    /// Bare nixbase32 digest.
    pub fn to_nix32(&self) -> String {
        base32::encode(&self.digest)
    }
    /// Hashes `data` in one go.
    pub fn digest_bytes(algo: HashAlgo, data: &[u8]) -> Self {
        let mut h = Hasher::new(algo);
        h.update(data);
        h.finish()
    }
}

/// Prints `algo:<nixbase32>`, the narinfo form.
impl std::fmt::Display for Hash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.to_nix32_prefixed())
    }
}

impl std::str::FromStr for Hash {
    type Err = HashError;
    fn from_str(s: &str) -> Result<Self, HashError> {
        Hash::parse(s)
    }
}

#[derive(Clone)]
enum State {
    Md5(md5::Md5),
    Sha1(sha1::Sha1),
    Sha256(sha2::Sha256),
    Sha512(sha2::Sha512),
}

/// Incremental hashing; also a `Write` sink, and counts the bytes fed (NarSize).
#[derive(Clone)]
pub struct Hasher {
    state: State,
    len: u64,
}

impl Hasher {
    /// An empty hasher for `algo`.
    pub fn new(algo: HashAlgo) -> Self {
        let state = match algo {
            HashAlgo::Md5 => State::Md5(md5::Md5::new()),
            HashAlgo::Sha1 => State::Sha1(sha1::Sha1::new()),
            HashAlgo::Sha256 => State::Sha256(sha2::Sha256::new()),
            HashAlgo::Sha512 => State::Sha512(sha2::Sha512::new()),
        };
        Hasher { state, len: 0 }
    }
    /// Feeds bytes.
    pub fn update(&mut self, data: &[u8]) {
        self.len += data.len() as u64;
        match &mut self.state {
            State::Md5(h) => h.update(data),
            State::Sha1(h) => h.update(data),
            State::Sha256(h) => h.update(data),
            State::Sha512(h) => h.update(data),
        }
    }
    /// Bytes fed so far.
    pub fn len(&self) -> u64 {
        self.len
    }
    /// Whether nothing was fed yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The hash of everything fed.
    pub fn finish(self) -> Hash {
        let (algo, digest) = match self.state {
            State::Md5(h) => (HashAlgo::Md5, h.finalize().to_vec()),
            State::Sha1(h) => (HashAlgo::Sha1, h.finalize().to_vec()),
            State::Sha256(h) => (HashAlgo::Sha256, h.finalize().to_vec()),
            State::Sha512(h) => (HashAlgo::Sha512, h.finalize().to_vec()),
        };
        Hash { algo, digest }
    }
}

impl std::io::Write for Hasher {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A reader that hashes (and counts) every byte read through it.
pub struct HashingReader<R> {
    inner: R,
    hasher: Hasher,
}

impl<R: std::io::Read> HashingReader<R> {
    /// Wraps `inner`, hashing with `algo`.
    pub fn new(inner: R, algo: HashAlgo) -> Self {
        HashingReader { inner, hasher: Hasher::new(algo) }
    }
    /// Bytes read so far.
    pub fn len(&self) -> u64 {
        self.hasher.len()
    }
    /// Whether nothing was read yet.
    pub fn is_empty(&self) -> bool {
        self.hasher.is_empty()
    }
    /// The hash of everything read, and the inner reader.
    pub fn finish(self) -> (Hash, R) {
        (self.hasher.finish(), self.inner)
    }
}

impl<R: std::io::Read> std::io::Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(buf.get(..n).unwrap_or(&[]));
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EMPTY_HEX: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";
    const EMPTY_32: &str = "0mdqa9w1p6cmli6976v4wi0sw9r4p5prkj7lzfd1877wk11c9c73";
    const EMPTY_SRI: &str = "sha256-47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=";

    #[test]
    fn all_encodings_parse_to_one_hash() {
        let h = Hash::digest_bytes(HashAlgo::Sha256, b"");
        assert_eq!(h.to_base16(), EMPTY_HEX);
        assert_eq!(h.to_nix32(), EMPTY_32);
        assert_eq!(h.to_sri(), EMPTY_SRI);
        assert_eq!(h.to_nix32_prefixed(), format!("sha256:{EMPTY_32}"));
        assert_eq!(h.to_base16_prefixed(), format!("sha256:{EMPTY_HEX}"));
        for s in [
            format!("sha256:{EMPTY_HEX}"),
            format!("sha256:{}", EMPTY_HEX.to_uppercase()),
            format!("sha256:{EMPTY_32}"),
            "sha256:47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=".to_owned(),
            EMPTY_SRI.to_owned(),
        ] {
            assert_eq!(Hash::parse(&s).unwrap(), h, "{s}");
        }
        assert_eq!(Hash::parse_sri(EMPTY_SRI).unwrap(), h);
    }

    #[test]
    fn other_algos() {
        assert_eq!(Hash::digest_bytes(HashAlgo::Md5, b"").to_base16(), "d41d8cd98f00b204e9800998ecf8427e");
        assert_eq!(Hash::digest_bytes(HashAlgo::Sha1, b"").to_base16(), "da39a3ee5e6b4b0d3255bfef95601890afd80709");
        let h = Hash::digest_bytes(HashAlgo::Sha512, b"abc");
        assert_eq!(Hash::parse(&h.to_nix32_prefixed()).unwrap(), h);
        assert_eq!(Hash::parse(&h.to_sri()).unwrap(), h);
        assert_eq!(Hash::parse(&h.to_base16_prefixed()).unwrap(), h);
    }

    #[test]
    fn rejects() {
        assert!(matches!(Hash::parse("sha256"), Err(HashError::MissingAlgo(_))));
        assert!(matches!(Hash::parse("sha3:abc"), Err(HashError::UnknownAlgo(_))));
        assert!(matches!(Hash::parse(&format!("sha256:{}", &EMPTY_HEX[1..])), Err(HashError::BadEncoding { .. })));
        assert!(matches!(Hash::parse(&format!("sha256:{}", "e".repeat(52))), Err(HashError::BadEncoding { .. })));
        assert!(matches!(Hash::parse(&format!("sha256-{EMPTY_HEX}")), Err(HashError::BadEncoding { .. })));
        assert!(Hash::parse(&format!("sha256:{}", "g".repeat(64))).is_err());
        assert!(Hash::new(HashAlgo::Sha256, &[0; 20]).is_none());
    }

    #[test]
    fn hasher_counts_and_reader_hashes() {
        use std::io::Read as _;
        let mut r = HashingReader::new(&b"hello world"[..], HashAlgo::Sha256);
        let mut buf = Vec::new();
        r.read_to_end(&mut buf).unwrap();
        assert_eq!(r.len(), 11);
        let (h, _) = r.finish();
        assert_eq!(h, Hash::digest_bytes(HashAlgo::Sha256, b"hello world"));
        let mut w = Hasher::new(HashAlgo::Sha256);
        std::io::Write::write_all(&mut w, b"hello ").unwrap();
        w.update(b"world");
        assert_eq!(w.len(), 11);
        assert_eq!(w.finish(), h);
    }
}
