//! Protocol features (Nix 2.24+, protocol ≥ 1.38; `WorkerProto::Feature` in
//! `worker-protocol.hh`, the exchange in `worker-protocol-connection.cc`'s `handshake`): right
//! after the version numbers, the client sends the features it supports and the daemon
//! answers with its own, each a list of strings (Nix writes a sorted `std::set`). Both use the
//! intersection. Nix 2.24–2.26 send none; the names below are those clients send today.

use std::collections::BTreeSet;
use std::io::{self, Read, Write};

use super::{read_strings, write_strings, ProtocolVersion, WireError};

/// The first version whose handshake exchanges features.
pub const FEATURES_VERSION: ProtocolVersion = ProtocolVersion::new(1, 38);

/// AddTempRoots (op 49): a path set made temporary roots in one request (DeterminateSystems'
/// Nix, `featureAddTempRoots`).
pub const ADD_TEMP_ROOTS: &str = "addTempRoots";

/// QueryPathInfos (op 50): the infos of the valid paths of a set in one request
/// (DeterminateSystems' Nix, `featureQueryPathInfos`).
pub const QUERY_PATH_INFOS: &str = "queryPathInfos";

/// sluice's own: once the greeting is over, both directions of the connection are zstd
/// streams (`sluice_compress::zstd_channel`), so that NARs travel compressed between two sluice
/// ends over ssh. Offered over standard input and output only (`ssh-ng://`, `sluice daemon
/// --stdio`); Nix ignores a feature it does not know (`intersectFeatures`,
/// `worker-protocol-connection.cc`), and never offers it.
pub const SLUICE_ZSTD: &str = "sluice-zstd";

/// sluice's own: QueryClosureInfos ([`crate::wire::ops::Op::QueryClosureInfos`]), a path set
/// in, the infos of its whole closure out, so that a client finds a closure in one round trip
/// where QueryPathInfos takes one per level of references (the serve protocol's QueryClosure,
/// `serve-protocol.hh`, answers paths only). Offered by `sluice daemon` to every client; Nix
/// ignores it.
pub const SLUICE_QUERY_CLOSURE: &str = "sluice-query-closure";

/// Most features read from a peer.
const MAX_FEATURES: u64 = 1024;
/// Longest feature name read from a peer, in bytes.
const MAX_FEATURE_LEN: u64 = 256;

/// A set of protocol features, sorted as Nix's `std::set` sends them.
pub type FeatureSet = BTreeSet<String>;

/// Reads a peer's features (at most 1024 names of at most 256 bytes); `what` names the side.
pub fn read_features(r: &mut (impl Read + ?Sized), what: &'static str) -> Result<FeatureSet, WireError> {
    Ok(read_strings(r, MAX_FEATURES, MAX_FEATURE_LEN, what)?.into_iter().collect())
}

/// Writes `features` as Nix does: a count, then each name, in sorted order.
pub fn write_features(w: &mut (impl Write + ?Sized), features: &FeatureSet) -> io::Result<()> {
    write_strings(w, features.iter())
}

/// The features named in `ours` (given as names) that `theirs` has too: the negotiated set.
pub fn negotiated(ours: &[&str], theirs: &FeatureSet) -> FeatureSet {
    ours.iter().filter(|f| theirs.contains(**f)).map(|f| (*f).to_owned()).collect()
}

/// `names` as a set.
pub fn feature_set(names: &[&str]) -> FeatureSet {
    names.iter().map(|f| (*f).to_owned()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn features_are_a_sorted_string_list_and_negotiation_intersects() {
        let mut bytes = Vec::new();
        write_features(&mut bytes, &feature_set(&[QUERY_PATH_INFOS, ADD_TEMP_ROOTS])).unwrap();
        // Count 2, then "addTempRoots" (12 bytes, padded to 16), then "queryPathInfos" (14 → 16).
        assert_eq!(bytes.len(), 8 + 8 + 16 + 8 + 16);
        assert_eq!(u64::from_le_bytes(bytes[..8].try_into().unwrap()), 2);
        assert_eq!(&bytes[16..28], b"addTempRoots");
        let back = read_features(&mut bytes.as_slice(), "features").unwrap();
        assert_eq!(back.iter().map(String::as_str).collect::<Vec<_>>(), [ADD_TEMP_ROOTS, QUERY_PATH_INFOS]);
        let theirs = feature_set(&[QUERY_PATH_INFOS, "provenance"]);
        assert_eq!(negotiated(&[ADD_TEMP_ROOTS, QUERY_PATH_INFOS], &theirs), feature_set(&[QUERY_PATH_INFOS]));
        assert!(negotiated(&[ADD_TEMP_ROOTS], &FeatureSet::new()).is_empty());
    }

    #[test]
    fn a_hostile_feature_list_is_bounded() {
        let mut bytes = 1_000_000u64.to_le_bytes().to_vec();
        bytes.extend(8u64.to_le_bytes());
        let err = read_features(&mut bytes.as_slice(), "client features").unwrap_err();
        assert!(err.to_string().contains("client features"), "{err}");
    }
}
