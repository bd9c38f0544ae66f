//! The Nix worker protocol's wire formats (client ↔ `nix-daemon`), over `Read`/`Write`.
//! Sources: Nix `src/libutil/serialise.{hh,cc}` (integers, strings, framed streams),
//! `src/libstore/worker-protocol.{hh,cc}` and `worker-protocol-connection.cc` (versions,
//! stderr channel, per-type serialisers), `src/libstore/common-protocol.cc`,
//! `src/libstore/derivations.cc` (basic derivations), and for the 2.8 era
//! `src/libstore/daemon.cc` and `path-info.cc` (`ValidPathInfo::write`).
//!
//! Every integer is a u64 little-endian; a string is its u64 length, its bytes, and zero
//! padding to a multiple of 8. Readers take a maximum length for every string and list and
//! never allocate more than they have actually received, so a declared length cannot take
//! memory; exceeding a bound is a [`WireError::TooLong`] naming the field.

mod derivation;
mod error;
pub mod features;
mod framed;
pub mod ops;
mod primitives;
pub mod serve;
mod stderr;
mod stderr_read;
mod types;
mod version;

pub(crate) use derivation::output_kind;
pub use derivation::{
    output_path_name, read_basic_derivation, write_basic_derivation, BasicDerivation, DerivationOutput, DrvOutput, OutputKind,
};
pub use error::WireError;
pub use framed::{FramedReader, FramedWriter, MAX_FRAME_LEN};
pub use primitives::{
    read_bool, read_bytes, read_string, read_string_pairs, read_strings, read_u64, write_bool, write_bytes, write_string_pairs,
    write_strings, write_u64,
};
pub use stderr::{ActivityField, StderrWriter};
pub use stderr_read::{read_stderr_message, StderrMessage};
pub use types::{
    read_build_result, read_content_address, read_derived_paths, read_keyed_build_result, read_keyed_path_info, read_optional_store_path,
    read_store_path, read_store_path_set, read_trusted_flag, read_unkeyed_path_info, write_build_result, write_content_address,
    write_derived_path, write_keyed_build_result, write_keyed_path_info, write_optional_store_path, write_store_path, write_store_path_set,
    write_trusted_flag, write_unkeyed_path_info, BuildMode, BuildResult, BuildStatus, DerivedPath, OutputsSpec, MAX_PATH_LEN,
};
pub use version::ProtocolVersion;

/// First word a client sends (`WORKER_MAGIC_1`, the bytes `cxin`).
pub const WORKER_MAGIC_1: u64 = 0x6e69_7863;
/// The daemon's answer to [`WORKER_MAGIC_1`] (`WORKER_MAGIC_2`, `oixd`).
pub const WORKER_MAGIC_2: u64 = 0x6478_696f;

/// Stderr-channel message tags (`STDERR_*` in `worker-protocol.hh`).
pub mod stderr_tag {
    /// A log line: followed by a string.
    pub const NEXT: u64 = 0x6f6c_6d67;
    /// The daemon wants data (legacy import): followed by a u64 maximum length.
    pub const READ: u64 = 0x6461_7461;
    /// Data for the client (legacy export): followed by a string.
    pub const WRITE: u64 = 0x6461_7416;
    /// The operation succeeded; its result follows.
    pub const LAST: u64 = 0x616c_7473;
    /// The operation failed; an error follows and no result.
    pub const ERROR: u64 = 0x6378_7470;
    /// An activity starts: id, level, type, text, fields, parent.
    pub const START_ACTIVITY: u64 = 0x5354_5254;
    /// An activity stops: id.
    pub const STOP_ACTIVITY: u64 = 0x5354_4f50;
    /// An activity result: id, type, fields.
    pub const RESULT: u64 = 0x5253_4c54;
}
