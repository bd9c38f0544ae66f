//! Why paths could not be substituted or copied, and the report's lines that group them by
//! cause (`substitute.rs`, `push.rs`; Nix prints one error per path, or stops at the first).

use std::collections::BTreeMap;

use sluice_nix::store_path::{StoreDir, StorePath};

use crate::store::StoreError;
use sluice_binary_cache::CacheError;
use sluice_local_store::LocalStoreError;

/// The kind of reason a path could not be substituted or copied: what reports group paths by.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Cause {
    /// No trusted key signed it (the store's [`LocalStoreError::Untrusted`]): the key names
    /// of its signatures (none if unsigned) and of `trusted-public-keys`.
    Untrusted { signers: Vec<String>, trusted: Vec<String> },
    /// The cache at `url` failed as a whole (unreachable, TLS, 401, 407) and was given up on,
    /// or (a copy into it) refused the path's upload.
    Cache { url: String },
    /// No substituter has it.
    Unknown,
    /// One of its references could not be substituted or copied.
    Reference,
    /// A reason of the path's own (a hash mismatch, a malformed narinfo, a missing NAR, …).
    Other,
}

impl Cause {
    /// The cause of the store's refusal `e`: an untrusted path, else the path's own.
    fn of_store(e: &LocalStoreError) -> Self {
        match e {
            LocalStoreError::Untrusted { signers, trusted, .. } => Cause::Untrusted { signers: signers.clone(), trusted: trusted.clone() },
            _ => Cause::Other,
        }
    }

    /// The cause of the cache at `url` failing with `e`: the whole cache's, or the path's own.
    fn of_cache(url: &str, e: &CacheError) -> Self {
        match e.is_cache_wide() {
            true => Cause::Cache { url: url.to_owned() },
            false => Cause::Other,
        }
    }
}

/// Why a path could not be substituted or copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub cause: Cause,
    /// The whole reason, naming the path and the URL, field or hash concerned.
    pub message: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl Failure {
    /// A reason of the path's own.
    pub(crate) fn other(message: String) -> Self {
        Failure { cause: Cause::Other, message }
    }

    /// The store refused the path (`url` is where it came from).
    pub(crate) fn store(url: &str, e: &LocalStoreError) -> Self {
        Failure { cause: Cause::of_store(e), message: format!("{url}: {e}") }
    }

    /// The cache at `url` failed with `e`.
    pub(crate) fn cache(url: &str, e: &CacheError) -> Self {
        Failure { cause: Cause::of_cache(url, e), message: e.to_string() }
    }

    /// Copying the path shown as `shown` failed with `e`, at the store `url` (the source while
    /// its NAR was asked for, else the destination): a cache that failed as a whole or refused
    /// the upload, a reference that failed and an untrusted path are causes; the message is
    /// `e`'s, after the path.
    pub(crate) fn copy(shown: &str, url: &str, e: &StoreError) -> Self {
        let cause = match e {
            StoreError::Cache(CacheError::Refused { .. }) => Cause::Cache { url: url.to_owned() },
            StoreError::Cache(c) => Cause::of_cache(url, c),
            StoreError::Local(l) => Cause::of_store(l),
            StoreError::ReferenceFailed { .. } => Cause::Reference,
            _ => Cause::Other,
        };
        Failure { cause, message: format!("{shown}: {e}") }
    }

    /// The failures of one path at several substituters, as one: their common cause (else
    /// [`Cause::Other`]) and their messages, prefixed with the path.
    pub(crate) fn combine(shown: &str, failures: Vec<Failure>) -> Self {
        let cause = match failures.first() {
            Some(first) if failures.iter().all(|f| f.cause == first.cause) => first.cause.clone(),
            _ => Cause::Other,
        };
        let messages: Vec<String> = failures.into_iter().map(|f| f.message).collect();
        Failure { cause, message: format!("{shown}: {}", messages.join("; ")) }
    }
}

/// Most paths a grouped failure line names.
const NAMED: usize = 3;

/// The failures of `failed` grouped by [`Cause`], one line each (without `error: `): a cause
/// that only one path has keeps that path's whole message; a cause many paths share says how
/// many, names a few, and says what to do about it. `done` is what was not done to them:
/// `"substituted"` or `"copied"`.
pub fn summarize(store_dir: &StoreDir, failed: &BTreeMap<StorePath, Failure>, done: &str) -> Vec<String> {
    let mut groups: BTreeMap<&Cause, Vec<(&StorePath, &Failure)>> = BTreeMap::new();
    for (path, failure) in failed {
        groups.entry(&failure.cause).or_default().push((path, failure));
    }
    let mut lines = Vec::new();
    for (cause, members) in groups {
        match (members.len() > 1).then(|| grouped(store_dir, cause, &members, done)).flatten() {
            Some(line) => lines.push(line),
            None => lines.extend(members.iter().map(|(_, f)| f.message.clone())),
        }
    }
    lines
}

/// The one line of the `members` failing for `cause` (see [`summarize`]); `None` for
/// [`Cause::Other`], whose paths failed for causes of their own and are named one by one.
fn grouped(store_dir: &StoreDir, cause: &Cause, members: &[(&StorePath, &Failure)], done: &str) -> Option<String> {
    let (n, first) = (members.len(), members.first()?.1);
    let mut named: Vec<String> = members.iter().take(NAMED).map(|(p, _)| store_dir.display_path(p)).collect();
    if n > NAMED {
        named.push(format!("and {} more", n - NAMED));
    }
    let named = named.join(", ");
    Some(match cause {
        Cause::Untrusted { signers, trusted } => {
            let unverified = sluice_local_store::unverified_signers(signers, trusted);
            let trusted = if trusted.is_empty() { "no key".to_owned() } else { trusted.join(", ") };
            match (signers.is_empty(), unverified.is_empty()) {
                (true, _) => format!("{n} paths lack a signature by a trusted key: they have no signature (trusted-public-keys has {trusted}); mark the substituter '?trusted=true' if you trust it to serve unsigned paths ({named})"),
                (false, false) => format!(
                    "{n} paths lack a valid signature by a trusted key: their signatures by {} do not verify (not made over their NAR hash, size and references) ({named})",
                    unverified.join(", ")
                ),
                (false, true) => format!(
                    "{n} paths lack a signature by a trusted key: they are signed by {} but trusted-public-keys has {trusted}; if you trust that key, add it to trusted-public-keys ({named})",
                    signers.join(", ")
                ),
            }
        }
        Cause::Cache { url } => format!("{n} paths could not be {done} because {url} failed: {} ({named})", first.message),
        Cause::Unknown => format!("no substituter has these {n} paths: {named}"),
        Cause::Reference => format!("{n} paths were not {done} because a path they refer to failed ({named})"),
        Cause::Other => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The store path whose hash part is `c` 32 times.
    fn path(c: char) -> StorePath {
        StoreDir::default().parse_path(&format!("/nix/store/{}-p", c.to_string().repeat(32))).unwrap()
    }

    /// Paths signed under a trusted key's name whose signatures do not verify are told apart
    /// from paths signed by a key that is not trusted.
    #[test]
    fn signatures_that_do_not_verify_are_named_so() {
        let dir = StoreDir::default();
        let untrusted = |signer: &str| Cause::Untrusted { signers: vec![signer.into()], trusted: vec!["cache-1".into()] };
        let mut failed = BTreeMap::new();
        for (c, signer) in [('0', "cache-1"), ('1', "cache-1"), ('2', "other-1"), ('3', "other-1")] {
            failed.insert(path(c), Failure { cause: untrusted(signer), message: String::new() });
        }
        let p = |c: char| dir.display_path(&path(c));
        assert_eq!(
            summarize(&dir, &failed, "substituted"),
            [
                format!("2 paths lack a valid signature by a trusted key: their signatures by cache-1 do not verify (not made over their NAR hash, size and references) ({}, {})", p('0'), p('1')),
                format!("2 paths lack a signature by a trusted key: they are signed by other-1 but trusted-public-keys has cache-1; if you trust that key, add it to trusted-public-keys ({}, {})", p('2'), p('3')),
            ]
        );
    }

    /// Causes many paths share are one line each, with the count and a few paths; a cause of
    /// one path, and reasons of a path's own, keep the path's whole message.
    #[test]
    fn summarize_groups_by_cause() {
        let dir = StoreDir::default();
        let mut failed = BTreeMap::new();
        let cache = Cause::Cache { url: "https://c.example".into() };
        for c in ['0', '1', '2', '3', '4'] {
            failed.insert(path(c), Failure { cause: cache.clone(), message: format!("{c}: https://c.example/x.narinfo: HTTP status 401") });
        }
        failed.insert(path('5'), Failure { cause: Cause::Unknown, message: "5: no substituter has this path".into() });
        for (own, referrer) in [('6', '8'), ('7', '9')] {
            failed.insert(path(own), Failure::other(format!("{own}: NAR hash mismatch")));
            failed.insert(path(referrer), Failure { cause: Cause::Reference, message: format!("{referrer}: its reference {own} …") });
        }
        let p = |c: char| dir.display_path(&path(c));
        assert_eq!(
            summarize(&dir, &failed, "substituted"),
            [
                format!("5 paths could not be substituted because https://c.example failed: 0: https://c.example/x.narinfo: HTTP status 401 ({}, {}, {}, and 2 more)", p('0'), p('1'), p('2')),
                "5: no substituter has this path".to_owned(),
                format!("2 paths were not substituted because a path they refer to failed ({}, {})", p('8'), p('9')),
                "6: NAR hash mismatch".to_owned(),
                "7: NAR hash mismatch".to_owned(),
            ]
        );
    }
}
