//! Hashes as Nix prints them: `algo:base16`, `algo:nixbase32`, `algo:base64` and SRI
//! (`algo-base64`). Source: Nix `src/libutil/hash.cc`.

/// A hash algorithm Nix knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum HashAlgo { Md5, Sha1, Sha256, Sha512 }

/// A hash: algorithm and digest (16, 20, 32 or 64 bytes).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Hash { algo: HashAlgo, digest: Vec<u8> }

/// Errors parsing a hash.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HashError {
    #[error("unknown hash algorithm {0:?}")]
    UnknownAlgo(String),
    #[error("hash {0:?} has no algorithm prefix")]
    MissingAlgo(String),
    #[error("hash {hash:?} is not valid base16, nixbase32 or base64 for {algo}")]
    BadEncoding { hash: String, algo: &'static str },
}

impl HashAlgo {
    /// Nix's name: `md5`, `sha1`, `sha256`, `sha512`.
    pub fn name(self) -> &'static str { todo!() }
    /// Digest length in bytes.
    pub fn digest_len(self) -> usize { todo!() }
    /// Parses Nix's name.
    pub fn parse(s: &str) -> Result<Self, HashError> { todo!() }
}

impl Hash {
    /// Builds a hash from a digest of the right length for `algo`.
    pub fn new(algo: HashAlgo, digest: &[u8]) -> Option<Self> { todo!() }
    pub fn algo(&self) -> HashAlgo { self.algo }
    pub fn digest(&self) -> &[u8] { &self.digest }
    /// Parses `algo:<base16|nixbase32|base64>` or SRI `algo-<base64>`.
    pub fn parse(s: &str) -> Result<Self, HashError> { todo!() }
    /// Parses a digest without prefix in base16, nixbase32 or base64 (told apart by length).
    pub fn parse_bare(s: &str, algo: HashAlgo) -> Result<Self, HashError> { todo!() }
    /// `sha256:<nixbase32>`, as in narinfo files.
    pub fn to_nix32_prefixed(&self) -> String { todo!() }
    /// `sha256:<base16>`, as in Nix's database (ValidPaths.hash).
    pub fn to_base16_prefixed(&self) -> String { todo!() }
    /// `sha256-<base64>`, as in `nix path-info --json`.
    pub fn to_sri(&self) -> String { todo!() }
    /// Bare lowercase base16 digest.
    pub fn to_base16(&self) -> String { todo!() }
    /// Bare nixbase32 digest.
    pub fn to_nix32(&self) -> String { todo!() }
    /// Hashes `data` in one go.
    pub fn digest_bytes(algo: HashAlgo, data: &[u8]) -> Self { todo!() }
}

/// Incremental hashing; also a `Write` sink, and counts the bytes fed (NarSize).
pub struct Hasher { /* private */ }

impl Hasher {
    pub fn new(algo: HashAlgo) -> Self { todo!() }
    pub fn update(&mut self, data: &[u8]) { todo!() }
    /// Bytes fed so far.
    pub fn len(&self) -> u64 { todo!() }
    pub fn finish(self) -> Hash { todo!() }
}

impl std::io::Write for Hasher {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> { self.update(buf); Ok(buf.len()) }
    fn flush(&mut self) -> std::io::Result<()> { Ok(()) }
}

/// A reader that hashes (and counts) every byte read through it.
pub struct HashingReader<R> { inner: R, hasher: Hasher }

impl<R: std::io::Read> HashingReader<R> {
    pub fn new(inner: R, algo: HashAlgo) -> Self { HashingReader { inner, hasher: Hasher::new(algo) } }
    /// Bytes read so far.
    pub fn len(&self) -> u64 { self.hasher.len() }
    /// The hash of everything read, and the inner reader.
    pub fn finish(self) -> (Hash, R) { (self.hasher.finish(), self.inner) }
}

impl<R: std::io::Read> std::io::Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}
