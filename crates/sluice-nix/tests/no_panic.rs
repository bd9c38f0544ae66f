//! Parsers return errors, never panic, on arbitrary input.

use proptest::prelude::*;
use sluice_nix::signature::{PublicKey, SecretKey, TrustedKeys};
use sluice_nix::store_path::{StoreDir, StorePath};
use sluice_nix::{base32, cache_info::CacheInfo, content_address::ContentAddress, hash::Hash, narinfo::NarInfo};

proptest! {
    #[test]
    fn text_parsers(s in "\\PC{0,120}", t in "[a-zA-Z:0-9 \\n-]{0,200}") {
        for x in [&s, &t] {
            let _ = base32::decode(x);
            let _ = Hash::parse(x);
            let _ = StorePath::from_base_name(x);
            let _ = StoreDir::default().parse_path(x);
            let _ = StoreDir::default().to_store_path(x);
            let _ = ContentAddress::parse(x);
            let _ = NarInfo::parse(&StoreDir::default(), x);
            let _ = CacheInfo::parse(x);
            let _ = PublicKey::parse(x);
            let _ = SecretKey::parse(x);
            let _ = TrustedKeys::parse(x);
        }
    }

    #[test]
    fn base32_round_trip(bytes in prop::collection::vec(any::<u8>(), 0..80)) {
        prop_assert_eq!(base32::decode(&base32::encode(&bytes)).unwrap(), bytes);
    }
}
