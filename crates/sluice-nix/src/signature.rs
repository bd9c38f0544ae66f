//! ed25519 keys and signatures in Nix's format: `name:base64(key)`, signatures
//! `name:base64(sig)`. Source: Nix `src/libutil/signature/local-keys.cc` (`crypto.cc` in 2.8).

/// Errors parsing keys or signatures.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("key {0:?} is not of the form name:base64")]
    Malformed(String),
    #[error("key {0:?} has the wrong length")]
    BadLength(String),
}

/// A public key `name:base64(32 bytes)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicKey { name: String, key: ed25519_dalek::VerifyingKey }

/// A secret key `name:base64(64 bytes: seed + public)`.
pub struct SecretKey { name: String, key: ed25519_dalek::SigningKey }

impl PublicKey {
    pub fn parse(s: &str) -> Result<Self, KeyError> { todo!() }
    pub fn name(&self) -> &str { &self.name }
    /// Whether `sig` (`name:base64`) is this key's valid signature of `fingerprint`. A
    /// signature with another key name or malformed base64 gives `false`.
    pub fn verify(&self, fingerprint: &str, sig: &str) -> bool { todo!() }
}

impl std::fmt::Display for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { todo!() }
}

impl SecretKey {
    pub fn parse(s: &str) -> Result<Self, KeyError> { todo!() }
    pub fn generate(name: &str) -> Self { todo!() }
    pub fn to_public(&self) -> PublicKey { todo!() }
    /// `name:base64(signature)`.
    pub fn sign(&self, fingerprint: &str) -> String { todo!() }
}

impl std::fmt::Display for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { todo!() }
}

/// A set of trusted public keys (`trusted-public-keys`).
#[derive(Debug, Clone, Default)]
pub struct TrustedKeys { keys: Vec<PublicKey> }

impl TrustedKeys {
    /// Parses space-separated keys.
    pub fn parse(s: &str) -> Result<Self, KeyError> { todo!() }
    /// Number of the `sigs` that a trusted key verifies over `fingerprint`.
    pub fn count_valid<'a>(&self, fingerprint: &str, sigs: impl IntoIterator<Item = &'a String>) -> usize { todo!() }
}
