//! ed25519 keys and signatures in Nix's format: `name:base64(key)`, signatures
//! `name:base64(sig)`. Source: Nix `src/libutil/signature/local-keys.cc` (`crypto.cc` in 2.8).
//!
//! A signature is over the UTF-8 bytes of a fingerprint (for store paths, see
//! [`crate::narinfo::NarInfo::fingerprint`]). Verification never fails hard: a malformed
//! signature (no `:`, bad base64, not 64 bytes) simply does not verify.

use base64::Engine as _;
use ed25519_dalek::{Signer as _, Verifier as _};

use crate::quoted::Quoted;

/// Errors parsing keys or signatures.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KeyError {
    #[error("key {} is not of the form name:base64", Quoted(.0))]
    Malformed(String),
    #[error("key {} has the wrong length", Quoted(.0))]
    BadLength(String),
}

/// A public key `name:base64(32 bytes)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicKey {
    name: String,
    key: ed25519_dalek::VerifyingKey,
}

/// A secret key `name:base64(64 bytes: seed + public)`.
pub struct SecretKey {
    name: String,
    key: ed25519_dalek::SigningKey,
}

fn b64() -> &'static base64::engine::GeneralPurpose {
    &base64::engine::general_purpose::STANDARD
}

/// Splits `name:base64` and decodes the base64 into exactly `N` bytes. The error shows only
/// the name, never key material.
fn split_key<const N: usize>(s: &str) -> Result<(String, [u8; N]), KeyError> {
    let s = s.trim();
    let (name, data) = s.split_once(':').ok_or_else(|| KeyError::Malformed(redact(s)))?;
    if name.is_empty() {
        return Err(KeyError::Malformed(redact(s)));
    }
    let bytes = b64().decode(data).map_err(|_| KeyError::Malformed(redact(s)))?;
    let arr = <[u8; N]>::try_from(bytes.as_slice()).map_err(|_| KeyError::BadLength(redact(s)))?;
    Ok((name.to_owned(), arr))
}

/// `name:…`: what may be shown of a key in an error.
fn redact(s: &str) -> String {
    match s.split_once(':') {
        Some((name, _)) => format!("{name}:…"),
        None => "…".to_owned(),
    }
}

/// Splits a signature `name:base64` into its key name and 64 signature bytes.
pub fn parse_signature(sig: &str) -> Option<(&str, ed25519_dalek::Signature)> {
    let (name, data) = sig.split_once(':')?;
    let bytes = b64().decode(data).ok()?;
    let arr = <[u8; 64]>::try_from(bytes.as_slice()).ok()?;
    Some((name, ed25519_dalek::Signature::from_bytes(&arr)))
}

impl PublicKey {
    /// Parses `name:base64(32 bytes)`.
    pub fn parse(s: &str) -> Result<Self, KeyError> {
        let (name, bytes) = split_key::<32>(s)?;
        let key = ed25519_dalek::VerifyingKey::from_bytes(&bytes).map_err(|_| KeyError::Malformed(redact(s)))?;
        Ok(PublicKey { name, key })
    }
    /// The key name (before the `:`).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The 32 key bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        self.key.as_bytes()
    }
    /// Whether `sig` (`name:base64`) is this key's valid signature of `fingerprint`. A
    /// signature with another key name or malformed base64 gives `false`.
    pub fn verify(&self, fingerprint: &str, sig: &str) -> bool {
        match parse_signature(sig) {
            Some((name, s)) if name == self.name => self.key.verify(fingerprint.as_bytes(), &s).is_ok(),
            _ => false,
        }
    }
}

impl std::fmt::Display for PublicKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.name, b64().encode(self.key.as_bytes()))
    }
}

impl std::fmt::Debug for SecretKey {
    /// Shows the name and public half only.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretKey").field("name", &self.name).field("public", &self.to_public().to_string()).finish()
    }
}

impl SecretKey {
    /// Parses `name:base64(64 bytes)`: the 32-byte seed then the 32-byte public key, which must
    /// match the seed.
    pub fn parse(s: &str) -> Result<Self, KeyError> {
        let (name, bytes) = split_key::<64>(s)?;
        let mut keypair = bytes;
        let key = ed25519_dalek::SigningKey::from_keypair_bytes(&keypair).map_err(|_| KeyError::Malformed(redact(s)));
        keypair.fill(0);
        Ok(SecretKey { name, key: key? })
    }
    /// A new random key (from the OS's random source) named `name`.
    pub fn generate(name: &str) -> Self {
        SecretKey { name: name.to_owned(), key: ed25519_dalek::SigningKey::generate(&mut rand::rngs::OsRng) }
    }
    /// A key from a 32-byte seed (deterministic; for tests and key derivation).
    pub fn from_seed(name: &str, seed: &[u8; 32]) -> Self {
        SecretKey { name: name.to_owned(), key: ed25519_dalek::SigningKey::from_bytes(seed) }
    }
    /// The key name (before the `:`).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The matching public key, same name.
    pub fn to_public(&self) -> PublicKey {
        PublicKey { name: self.name.clone(), key: self.key.verifying_key() }
    }
    /// `name:base64(signature)`.
    pub fn sign(&self, fingerprint: &str) -> String {
        format!("{}:{}", self.name, b64().encode(self.key.sign(fingerprint.as_bytes()).to_bytes()))
    }
}

impl std::fmt::Display for SecretKey {
    /// The secret key file format `name:base64(seed + public)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.name, b64().encode(self.key.to_keypair_bytes()))
    }
}

/// A set of trusted public keys (`trusted-public-keys`).
#[derive(Debug, Clone, Default)]
pub struct TrustedKeys {
    keys: Vec<PublicKey>,
}

impl TrustedKeys {
    /// Parses space-separated keys.
    pub fn parse(s: &str) -> Result<Self, KeyError> {
        s.split_whitespace().map(PublicKey::parse).collect::<Result<Vec<_>, _>>().map(|keys| TrustedKeys { keys })
    }
    /// A set of the given keys.
    pub fn from_keys(keys: Vec<PublicKey>) -> Self {
        TrustedKeys { keys }
    }
    /// Adds a key.
    pub fn push(&mut self, key: PublicKey) {
        self.keys.push(key)
    }
    /// The keys, in the order given.
    pub fn keys(&self) -> &[PublicKey] {
        &self.keys
    }
    /// Whether some trusted key (same name and key bytes) verifies `sig` over `fingerprint`.
    pub fn verifies(&self, fingerprint: &str, sig: &str) -> bool {
        self.keys.iter().any(|k| k.verify(fingerprint, sig))
    }

    /// Whether some trusted key verifies one of `sigs` over `fingerprint`.
    pub fn verifies_any<'a>(&self, fingerprint: &str, sigs: impl IntoIterator<Item = &'a String>) -> bool {
        sigs.into_iter().any(|s| self.verifies(fingerprint, s))
    }

    /// [`TrustedKeys::verifies_any`] of each `(fingerprint, sigs)` item, in order, answered by
    /// one batch equation (ed25519-dalek's `verify_batch`) over each item's first signature
    /// named after a trusted key: about half the CPU per signature of checking each alone,
    /// once eight or more are together (15.7 against 33 µs here). An item with no signature
    /// named after a trusted key is `false`. `None` if the batch does not hold: some signature
    /// in it does not verify, and only checking each alone tells which (a hostile cache can
    /// make every batch fail, so the caller decides where those checks run).
    ///
    /// The batch equation holds for every signature that [`PublicKey::verify`] accepts. It may
    /// also hold for one that [`PublicKey::verify`] refuses, but only one made by the key's
    /// holder with a small-order point added to its `R`: the equation (without the cofactor)
    /// leaves that point times a random 128-bit factor, which is zero with a chance of 1/2 to
    /// 1/8 for such a signature. No one without the secret key can make one, so the answer
    /// to who signed is the same; for such a signature Nix's answer can differ from sluice's,
    /// and from one run to the next.
    pub fn verify_together<'a, S: IntoIterator<Item = &'a String> + Copy>(&self, items: &[(&str, S)]) -> Option<Vec<bool>> {
        let mut in_batch = vec![false; items.len()];
        let (mut messages, mut signatures, mut keys) = (Vec::new(), Vec::new(), Vec::new());
        for (i, (fingerprint, sigs)) in items.iter().enumerate() {
            let first = sigs.into_iter().find_map(|s| {
                let (name, sig) = parse_signature(s)?;
                Some((sig, self.keys.iter().find(|k| k.name == name)?))
            });
            if let Some((sig, key)) = first {
                in_batch[i] = true;
                messages.push(fingerprint.as_bytes());
                signatures.push(sig);
                keys.push(key.key);
            }
        }
        let holds = match signatures.len() {
            0 => true,
            // A batch of one costs more than the single check (46 against 33 µs).
            1 => keys[0].verify(messages[0], &signatures[0]).is_ok(),
            _ => ed25519_dalek::verify_batch(&messages, &signatures, &keys).is_ok(),
        };
        holds.then_some(in_batch)
    }

    /// Number of the `sigs` that a trusted key verifies over `fingerprint`. Identical signature
    /// strings count once; malformed ones count zero.
    pub fn count_valid<'a>(&self, fingerprint: &str, sigs: impl IntoIterator<Item = &'a String>) -> usize {
        let mut seen = std::collections::BTreeSet::new();
        sigs.into_iter().filter(|s| seen.insert(s.as_str()) && self.verifies(fingerprint, s)).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_verify_round_trip() {
        let sk = SecretKey::from_seed("test-1", &[7; 32]);
        let pk = sk.to_public();
        let sk2 = SecretKey::parse(&sk.to_string()).unwrap();
        assert_eq!(sk2.to_public(), pk);
        assert_eq!(PublicKey::parse(&pk.to_string()).unwrap(), pk);
        let sig = sk.sign("hello");
        assert!(pk.verify("hello", &sig));
        assert!(!pk.verify("hellO", &sig));
        let other = SecretKey::from_seed("test-1", &[8; 32]);
        assert!(!other.to_public().verify("hello", &sig));
        let relabelled = sig.replacen("test-1", "test-2", 1);
        assert!(!pk.verify("hello", &relabelled));
        let trusted = TrustedKeys::parse(&format!("  {} {} ", other.to_public(), pk)).unwrap();
        assert_eq!(trusted.keys().len(), 2);
        let bad = "test-1:!!!not*base64!!!".to_owned();
        let nocolon = "garbage".to_owned();
        assert_eq!(trusted.count_valid("hello", [&bad, &nocolon, &sig, &sig]), 1);
        assert!(!format!("{sk:?}").contains(&sk.to_string()));
    }

    /// A batch holds only if every batched signature verifies: a signature by the second of
    /// two trusted keys of one name fails the batch (the first is tried), as does a malformed
    /// signature's item's next one made over another text; a malformed signature is passed
    /// over for the item's next one; an item with no signature of a trusted name is `false`
    /// without failing the batch.
    #[test]
    fn verify_together_holds_only_if_each_verifies() {
        let (a, b) = (SecretKey::from_seed("k-1", &[1; 32]), SecretKey::from_seed("k-1", &[2; 32]));
        let trusted = TrustedKeys::from_keys(vec![a.to_public(), b.to_public()]);
        let one = |k: &SecretKey, m: &str| vec![k.sign(m)];
        let (s1, s2, unnamed) = (one(&a, "one"), one(&b, "two"), one(&SecretKey::from_seed("k-2", &[3; 32]), "three"));
        let (s3, s4) = (vec!["k-1:!!".to_owned(), a.sign("not three")], vec!["k-1:!!".to_owned(), a.sign("four")]);
        assert_eq!(trusted.verify_together(&[("one", &s1), ("three", &unnamed), ("four", &s4)]), Some(vec![true, false, true]));
        assert_eq!(trusted.verify_together(&[("one", &s1), ("two", &s2)]), None);
        assert_eq!(trusted.verify_together(&[("one", &s1), ("three", &s3)]), None);
        assert_eq!(trusted.verify_together(&[("two", &s2)]), None);
        assert_eq!(trusted.verify_together(&[("one", &s1)]), Some(vec![true]));
        assert_eq!(trusted.verify_together::<&Vec<String>>(&[]), Some(vec![]));
        for (text, sigs) in [("one", &s1), ("two", &s2), ("three", &s3), ("four", &s4), ("three", &unnamed)] {
            assert_eq!(trusted.verifies_any(text, sigs), text != "three", "{text}");
        }
    }

    #[test]
    fn malformed_keys() {
        assert!(matches!(PublicKey::parse("nocolon"), Err(KeyError::Malformed(_))));
        assert!(matches!(PublicKey::parse(":AAAA"), Err(KeyError::Malformed(_))));
        assert!(matches!(PublicKey::parse("k:!!"), Err(KeyError::Malformed(_))));
        assert!(matches!(PublicKey::parse("k:AAAA"), Err(KeyError::BadLength(_))));
        let sk = SecretKey::from_seed("k", &[1; 32]);
        // Secret key whose public half does not match its seed.
        let mut bytes = sk.key.to_keypair_bytes();
        bytes[40] ^= 1;
        assert!(SecretKey::parse(&format!("k:{}", b64().encode(bytes))).is_err());
        assert!(matches!(SecretKey::parse(&sk.to_public().to_string()), Err(KeyError::BadLength(_))));
    }
}
