//! Pure Nix formats: no network, no filesystem access beyond `Read`/`Write`, no panics on input.
//!
//! Every parser takes bytes or a reader and returns a value or a typed error naming what was
//! wrong; none allocates by a length read from its input without a bound.

pub mod base32;
pub mod cache_info;
pub mod content_address;
pub mod derivation;
pub mod hash;
pub mod hash_modulo;
pub mod nar;
pub mod narinfo;
pub mod path_info;
pub mod signature;
pub mod store_path;
pub mod wire;
