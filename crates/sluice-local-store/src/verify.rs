//! The verification boundary: the one decision of whether a path may become valid. Every
//! addition to a local store — substitution, the daemon's add operations of every form, CLI
//! copies — ends in [`super::PendingPath::commit`], which calls [`verify`] on what was
//! actually unpacked; there is no other way to register a path.
//!
//! A path is admitted when (Nix 2.8/2.26 `LocalStore::addToStore`, `ValidPathInfo::
//! checkSignatures`, `isContentAddressed`):
//! - its NAR hash and size are those of the unpacked NAR;
//! - if it has a content address, the address yields the path for its name and references,
//!   and the hash the address carries is the one computed from the unpacked content (the NAR
//!   for `fixed:r:`, modulo the path's own hash part when it refers to itself; the file for
//!   `fixed:` and `text:`), whoever vouches for the path: an address is a fact about the
//!   content, not a permission;
//! - it is vouched for ([`SignaturePolicy`]): a signature by a trusted key over its
//!   fingerprint, or a content address (checked as above), or the caller may add unsigned
//!   paths (`require-sigs = false`, a trusted client that asked not to check, or a
//!   substituter marked `?trusted=true`: [`SignaturePolicy::for_source`]);
//! - its references other than itself are valid (checked by the caller, in the same step);
//! - if it is a derivation (`.drv`), its output paths are the ones its contents imply
//!   ([`verify_derivation`], Nix's `checkDerivationOutputs`, which `registerValidPaths` runs for
//!   every derivation it registers): otherwise anyone who may add a `.drv` (any client, as a
//!   `text:` content address needs no signature) could claim another package's output path,
//!   and the first build of it would put their bytes there.

use sluice_nix::content_address::ContentAddress;
use std::collections::BTreeSet;

use sluice_nix::derivation::{drv_name, Derivation, DerivationError};
use sluice_nix::hash::{Hash, HashAlgo};
use sluice_nix::path_info::ValidPathInfo;
use sluice_nix::signature::TrustedKeys;
use sluice_nix::store_path::{StoreDir, StorePath};

use super::{LocalStore, LocalStoreError, Unpacked};

/// Who must vouch for a path that is added: the signatures that count, if any are required.
#[derive(Debug, Clone)]
pub struct SignaturePolicy {
    /// Nix's `require-sigs`; false also for a trusted client's `dontCheckSigs`.
    pub require_sigs: bool,
    /// `trusted-public-keys`.
    pub trusted_keys: TrustedKeys,
}

/// Why a path's info is accepted before its content is seen ([`SignaturePolicy::vouch`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Vouched {
    /// No signature is required.
    Unchecked,
    /// Signed by a trusted key.
    Signed,
    /// Content-addressed: its content will be checked against the address.
    ContentAddressed,
}

/// A path's info that a policy vouched for ([`SignaturePolicy::vouch_info`]), made only by
/// it: [`super::LocalStore::try_begin_add_vouched`] takes it, so that the commit of that
/// path under the same policy does not verify its signatures a second time (its hashes,
/// content address and references are checked at the commit whatever vouched for it).
#[derive(Debug, Clone)]
pub struct VouchedInfo {
    info: ValidPathInfo,
    policy: SignaturePolicy,
}

impl VouchedInfo {
    /// The info that was vouched for.
    pub fn info(&self) -> &ValidPathInfo {
        &self.info
    }

    /// The info and the policy that vouched for it.
    pub(super) fn into_parts(self) -> (ValidPathInfo, SignaturePolicy) {
        (self.info, self.policy)
    }
}

/// How the content hash of a content-addressed path is computed while its NAR is unpacked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum CaHashing {
    /// `fixed:r:sha256` without a self-reference: the NAR hash itself.
    NarHash,
    /// `fixed:r:<algo>`: the NAR with `algo`; modulo the path's hash part if it refers to itself.
    Nar { algo: HashAlgo, modulo: Option<String> },
    /// `fixed:<algo>` and `text:sha256`: the contents of the NAR's root regular file.
    Flat(HashAlgo),
}

/// The `trusted-public-keys` setting could not be read into keys.
#[derive(Debug, thiserror::Error)]
#[error("trusted-public-keys: {0}")]
pub struct TrustedKeysError(String);

impl SignaturePolicy {
    /// Nix's rule for whether paths added to a store need a trusted signature: the store's
    /// own `require-sigs` (its URL parameter, `store_require_sigs`) when given, else the
    /// global `require-sigs` setting it defaults to (`LocalStoreConfig::requireSigs`,
    /// `src/libstore/local-store.hh`); and never when the caller does not check signatures
    /// (`check_sigs` false: `nix copy --no-check-sigs`, a trusted daemon client's
    /// `dontCheckSigs`; `checkSigs = NoCheckSigs` in `src/libstore/local-store.cc`'s
    /// `addToStore`, which tests `requireSigs && checkSigs`).
    pub fn requires_sigs(setting: bool, store_require_sigs: Option<bool>, check_sigs: bool) -> bool {
        store_require_sigs.unwrap_or(setting) && check_sigs
    }

    /// The policy of a store whose additions need a trusted signature when `require_sigs`
    /// ([`requires_sigs`](Self::requires_sigs) of the settings and the store's URL), by one of
    /// `trusted_public_keys` (the setting, `name:base64` each). Errors: a key that does not
    /// parse ([`TrustedKeysError`], naming the setting).
    pub fn new(require_sigs: bool, trusted_public_keys: &[String]) -> Result<Self, TrustedKeysError> {
        Ok(SignaturePolicy {
            require_sigs,
            trusted_keys: TrustedKeys::parse(&trusted_public_keys.join(" ")).map_err(|e| TrustedKeysError(e.to_string()))?,
        })
    }

    /// A policy that requires no signature (a trusted client's `dontCheckSigs`).
    pub fn unchecked() -> Self {
        SignaturePolicy { require_sigs: false, trusted_keys: TrustedKeys::default() }
    }

    /// The policy for a path from a source that is trusted or not: no signature is required
    /// from a trusted one (Nix's `sub->isTrusted ? NoCheckSigs : CheckSigs` in
    /// `src/libstore/build/substitution-goal.cc`, `isTrusted` being the substituter URL's
    /// `trusted` parameter). Content addresses are still checked by [`verify`].
    pub fn for_source(&self, trusted: bool) -> std::borrow::Cow<'_, SignaturePolicy> {
        match trusted {
            true => std::borrow::Cow::Owned(SignaturePolicy::unchecked()),
            false => std::borrow::Cow::Borrowed(self),
        }
    }

    /// Whether the two policies admit the same paths: the same `require_sigs` and the same
    /// trusted keys, in the same order.
    pub(super) fn same_as(&self, other: &SignaturePolicy) -> bool {
        self.require_sigs == other.require_sigs && self.trusted_keys.keys() == other.trusted_keys.keys()
    }

    /// [`SignaturePolicy::vouch`], keeping the result as a [`VouchedInfo`].
    pub fn vouch_info(&self, store_dir: &StoreDir, info: ValidPathInfo) -> Result<VouchedInfo, LocalStoreError> {
        self.vouch(store_dir, &info)?;
        Ok(VouchedInfo { info, policy: self.clone() })
    }

    /// [`SignaturePolicy::vouch_info`] of each of `infos`, in order, with their signatures
    /// verified together ([`TrustedKeys::verify_together`]): the same verdicts at about half
    /// the CPU, for a substitution's narinfos found at once. `None` if a signature among them
    /// does not verify: each must then be vouched for alone to know which.
    pub fn vouch_all(&self, store_dir: &StoreDir, infos: Vec<ValidPathInfo>) -> Option<Vec<Result<VouchedInfo, LocalStoreError>>> {
        let signed = match self.require_sigs {
            true => {
                let fingerprints: Vec<String> = infos.iter().map(|info| info.fingerprint(store_dir)).collect();
                let items: Vec<_> = fingerprints.iter().zip(&infos).map(|(f, info)| (f.as_str(), &info.sigs)).collect();
                self.trusted_keys.verify_together(&items)?
            }
            false => vec![false; infos.len()],
        };
        let verdicts = infos.into_iter().zip(signed).map(|(info, signed)| {
            self.verdict(store_dir, &info, signed)?;
            Ok(VouchedInfo { info, policy: self.clone() })
        });
        Some(verdicts.collect())
    }

    /// Whether `info` may be added as far as its claims go: [`Vouched`], or
    /// [`LocalStoreError::Untrusted`] naming the signers and the trusted keys. A
    /// [`Vouched::ContentAddressed`] path is admitted only if [`verify`] then finds its
    /// content matching.
    pub fn vouch(&self, store_dir: &StoreDir, info: &ValidPathInfo) -> Result<Vouched, LocalStoreError> {
        let signed = self.require_sigs && self.trusted_keys.verifies_any(&info.fingerprint(store_dir), &info.sigs);
        self.verdict(store_dir, info, signed)
    }

    /// [`SignaturePolicy::vouch`]'s verdict on `info`, given whether a trusted key `signed`
    /// it (asked only if signatures are required).
    fn verdict(&self, store_dir: &StoreDir, info: &ValidPathInfo, signed: bool) -> Result<Vouched, LocalStoreError> {
        if !self.require_sigs {
            return Ok(Vouched::Unchecked);
        }
        if signed {
            return Ok(Vouched::Signed);
        }
        let implied = info.content_addressed_path(store_dir);
        if implied.as_ref() == Some(&info.path) {
            return Ok(Vouched::ContentAddressed);
        }
        if let Some(ca) = &info.ca {
            return Err(LocalStoreError::UnsignedFalseCa {
                path: store_dir.display_path(&info.path),
                ca: ca.to_string(),
                implied: implied_path(store_dir, implied),
            });
        }
        let signers = info.sigs.iter().map(|s| s.split(':').next().unwrap_or("").to_owned()).collect();
        let trusted = self.trusted_keys.keys().iter().map(|k| k.name().to_owned()).collect();
        Err(LocalStoreError::Untrusted { path: store_dir.display_path(&info.path), signers, trusted })
    }
}

/// The path a content address implies, as its refusals show it.
fn implied_path(store_dir: &StoreDir, implied: Option<StorePath>) -> String {
    implied.map_or_else(|| "no valid path (impossible with these references)".to_owned(), |p| store_dir.display_path(&p))
}

/// What must be hashed, besides the NAR's sha256, to check `info`'s content address.
pub(super) fn ca_hashing(info: &ValidPathInfo) -> Option<CaHashing> {
    Some(match info.ca.as_ref()? {
        ContentAddress::Fixed { recursive: true, hash } => {
            let modulo = info.has_self_reference().then(|| info.path.hash_part().to_owned());
            match (hash.algo(), modulo) {
                (HashAlgo::Sha256, None) => CaHashing::NarHash,
                (algo, modulo) => CaHashing::Nar { algo, modulo },
            }
        }
        ContentAddress::Fixed { recursive: false, hash } => CaHashing::Flat(hash.algo()),
        ContentAddress::Text(_) => CaHashing::Flat(HashAlgo::Sha256),
    })
}

/// The verification boundary (see the module documentation), for `info` against what was
/// `unpacked` for it. References are the caller's part. `vouched`: the policy that vouched
/// for this very `info` before its NAR was read ([`VouchedInfo`]); when it is `policy`, the
/// signatures are not verified again.
pub(super) fn verify(
    store_dir: &StoreDir,
    info: &ValidPathInfo,
    unpacked: &Unpacked,
    policy: &SignaturePolicy,
    vouched: Option<&SignaturePolicy>,
) -> Result<(), LocalStoreError> {
    let shown = || store_dir.display_path(&info.path);
    if unpacked.nar_hash != info.nar_hash {
        return Err(LocalStoreError::HashMismatch {
            path: shown(),
            expected: info.nar_hash.to_nix32_prefixed(),
            actual: unpacked.nar_hash.to_nix32_prefixed(),
        });
    }
    if unpacked.nar_size != info.nar_size {
        return Err(LocalStoreError::SizeMismatch { path: shown(), expected: info.nar_size, actual: unpacked.nar_size });
    }
    if let Some(ca) = &info.ca {
        let implied = info.content_addressed_path(store_dir);
        if implied.as_ref() != Some(&info.path) {
            return Err(LocalStoreError::CaPath { path: shown(), ca: ca.to_string(), implied: implied_path(store_dir, implied) });
        }
        let actual: Option<&Hash> = match ca_hashing(info) {
            Some(CaHashing::NarHash) => Some(&unpacked.nar_hash),
            _ => unpacked.ca_hash.as_ref(),
        };
        if actual != Some(ca.hash()) && unpacked.ca_hash_with_offsets.as_ref() != Some(ca.hash()) {
            return Err(LocalStoreError::CaMismatch {
                path: shown(),
                specified: ca.hash().to_nix32_prefixed(),
                actual: actual.map_or_else(|| "nothing: the NAR's root is not a regular file".to_owned(), Hash::to_nix32_prefixed),
            });
        }
    }
    if vouched.is_some_and(|v| v.same_as(policy)) {
        return Ok(());
    }
    policy.vouch(store_dir, info).map(|_| ())
}

/// The derivation check of the verification boundary (see the module documentation) for
/// `info`'s `.drv`, whose contents are `aterm`: it must parse (Nix's "error parsing
/// derivation"), every input derivation must be valid or committed before it in `batch` (Nix
/// reads them from the store directory whether valid or not), and its outputs must pass Nix's
/// `LocalStore::checkDerivationOutputs` ([`Derivation::check_outputs`], with the input
/// derivations' hashes from [`LocalStore::drv_hashes`]). Returns the outputs whose path is
/// known, to register in `DerivationOutputs` (a fixed output with the path its hash
/// implies, as Nix's `outputsAndOptPaths`, not the one written in the file).
pub(super) fn verify_derivation(
    store: &LocalStore,
    info: &ValidPathInfo,
    aterm: &[u8],
    batch: &BTreeSet<StorePath>,
) -> Result<Vec<(String, StorePath)>, LocalStoreError> {
    let dir = &store.store_dir;
    let shown = dir.display_path(&info.path);
    let parse_error = |e| LocalStoreError::Derivation { path: shown.clone(), source: e };
    let drv = Derivation::parse(dir, drv_name(&info.path), aterm).map_err(parse_error)?;
    let enabled = store.features.load(std::sync::atomic::Ordering::Relaxed);
    for needed in drv.required_experimental_features() {
        if enabled & feature_bit(needed) == 0 {
            let why = format!("experimental Nix feature '{needed}' is disabled; add '--extra-experimental-features {needed}' to enable it");
            return Err(parse_error(DerivationError(why)));
        }
    }
    let inputs: Vec<&StorePath> = drv.input_drvs.keys().filter(|p| !batch.contains(*p)).collect();
    let valid = store.registry.valid_paths(inputs.iter().copied())?;
    if let Some(input) = inputs.into_iter().find(|p| !valid.contains(*p)) {
        let why = format!("derivation '{shown}' has the input derivation '{}', which is not valid", dir.display_path(input));
        return Err(LocalStoreError::DerivationOutputs(DerivationError(why)));
    }
    drv.check_outputs(dir, &info.path, &mut |input| store.drv_hashes(input)).map_err(LocalStoreError::DerivationOutputs)?;
    let outputs = drv.output_paths(dir).map_err(parse_error)?;
    Ok(outputs.into_iter().filter_map(|(name, path)| Some((name, path?))).collect())
}

/// The bit of [`LocalStore`]'s enabled features that stands for the experimental feature
/// `name` (0 for a feature the registration of derivations does not depend on).
pub(super) fn feature_bit(name: &str) -> u8 {
    match name {
        "ca-derivations" => 1,
        "impure-derivations" => 2,
        "dynamic-derivations" => 4,
        _ => 0,
    }
}

#[cfg(test)]
mod policy_tests {
    use super::SignaturePolicy;

    #[test]
    fn require_sigs_rule_table() {
        // (global setting, URL's require-sigs, check_sigs) -> required, as Nix's
        // `requireSigs && checkSigs` with `requireSigs` defaulting to the setting.
        let table = [
            (true, None, true, true),
            (false, None, true, false),
            (true, Some(false), true, false),
            (false, Some(true), true, true),
            (true, Some(true), true, true),
            (true, None, false, false),
            (false, Some(true), false, false),
            (true, Some(true), false, false),
        ];
        for (setting, url, check, want) in table {
            assert_eq!(SignaturePolicy::requires_sigs(setting, url, check), want, "{setting} {url:?} {check}");
        }
    }
}
