//! SetOptions (Nix `daemon.cc` `wopSetOptions` and `ClientSettings`; `remote-store.cc`
//! `RemoteStore::setOptions` for the client's side).

use std::io::{self, Read, Write};

use super::super::{read_string_pairs, read_u64, write_string_pairs, write_u64};
use super::{Op, Request};
use crate::store_path::StoreDir;
use crate::wire::{ProtocolVersion, WireError};

/// The numeric settings of SetOptions, in their wire order (Nix's `ClientSettings`). Flags
/// are sent as 0 or 1 and read as any non-zero value; each number is kept as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientSettings {
    pub keep_failed: bool,
    pub keep_going: bool,
    pub try_fallback: bool,
    /// Nix's `Verbosity` number (0 error … 7 vomit).
    pub verbosity: u64,
    pub max_build_jobs: u64,
    /// Seconds; 0 is no limit.
    pub max_silent_time: u64,
    /// Obsolete (Nix sends 1 and ignores it).
    pub use_build_hook: bool,
    /// The verbosity of build logs (Nix's `Verbosity` number).
    pub build_verbosity: u64,
    /// Obsolete (Nix sends 0).
    pub log_type: u64,
    /// Obsolete (Nix sends 0).
    pub print_build_trace: u64,
    /// 0 is all cores.
    pub build_cores: u64,
    pub use_substitutes: bool,
}

impl Default for ClientSettings {
    /// Nix's defaults (`globals.hh`): nothing kept or retried, verbosity info (3), one build
    /// job, no silence limit, build hook on, builds at error verbosity (0), all cores,
    /// substitutes used.
    fn default() -> Self {
        ClientSettings {
            keep_failed: false,
            keep_going: false,
            try_fallback: false,
            verbosity: 3,
            max_build_jobs: 1,
            max_silent_time: 0,
            use_build_hook: true,
            build_verbosity: 0,
            log_type: 0,
            print_build_trace: 0,
            build_cores: 0,
            use_substitutes: true,
        }
    }
}

impl ClientSettings {
    /// The twelve numbers in wire order.
    pub fn to_words(&self) -> [u64; 12] {
        let b = u64::from;
        [
            b(self.keep_failed),
            b(self.keep_going),
            b(self.try_fallback),
            self.verbosity,
            self.max_build_jobs,
            self.max_silent_time,
            b(self.use_build_hook),
            self.build_verbosity,
            self.log_type,
            self.print_build_trace,
            self.build_cores,
            b(self.use_substitutes),
        ]
    }

    /// The settings of the twelve numbers `w`, in wire order (flags: non-zero is true).
    pub fn from_words(w: [u64; 12]) -> Self {
        ClientSettings {
            keep_failed: w[0] != 0,
            keep_going: w[1] != 0,
            try_fallback: w[2] != 0,
            verbosity: w[3],
            max_build_jobs: w[4],
            max_silent_time: w[5],
            use_build_hook: w[6] != 0,
            build_verbosity: w[7],
            log_type: w[8],
            print_build_trace: w[9],
            build_cores: w[10],
            use_substitutes: w[11] != 0,
        }
    }
}

/// Most setting overrides accepted in one SetOptions.
const MAX_OVERRIDES: u64 = 100_000;
/// Longest override name or value accepted, in bytes.
const MAX_OVERRIDE_LEN: u64 = 1 << 20;

/// SetOptions: the numeric settings, then (≥ 1.12) the overrides (name, value, in the order
/// sent) → nothing after `LAST`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SetOptions {
    pub settings: ClientSettings,
    /// Always empty before 1.12, which cannot send them.
    pub overrides: Vec<(String, String)>,
}

impl Request for SetOptions {
    const OP: Op = Op::SetOptions;
    /// Nix's client sends only the settings overridden on its command line or in
    /// `NIX_CONFIG` (`RemoteStore::setOptions`): a few KiB; this is a thousand times that.
    const MAX_BYTES: u64 = 4 << 20;

    fn read(r: &mut dyn Read, _: &StoreDir, version: ProtocolVersion) -> Result<Self, WireError> {
        let mut words = [0u64; 12];
        for word in &mut words {
            *word = read_u64(r, "SetOptions field")?;
        }
        let overrides =
            if version.at_least(12) { read_string_pairs(r, MAX_OVERRIDES, MAX_OVERRIDE_LEN, "setting override")? } else { Vec::new() };
        Ok(SetOptions { settings: ClientSettings::from_words(words), overrides })
    }

    fn write(&self, w: &mut dyn Write, _: &StoreDir, version: ProtocolVersion) -> io::Result<()> {
        self.settings.to_words().iter().try_for_each(|n| write_u64(w, *n))?;
        if version.at_least(12) {
            write_string_pairs(w, self.overrides.iter().map(|(k, v)| (k, v)))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{round_trip, words, VERSIONS};
    use super::*;

    #[test]
    fn round_trips() {
        let settings = ClientSettings {
            keep_going: true,
            verbosity: 5,
            max_build_jobs: 8,
            max_silent_time: 60,
            build_cores: 4,
            use_substitutes: false,
            ..ClientSettings::default()
        };
        for minor in VERSIONS.into_iter().chain([11]) {
            let overrides = if minor >= 12 {
                vec![("substituters".to_owned(), "https://a https://b".to_owned()), ("timeout".into(), "5".into())]
            } else {
                Vec::new()
            };
            let w = words(&round_trip(&SetOptions { settings, overrides }, minor));
            assert_eq!(w[..13], [19, 0, 1, 0, 5, 8, 60, 1, 0, 0, 0, 4, 0]);
            assert_eq!(w.len() > 13, minor >= 12, "overrides only from 1.12");
        }
    }

    #[test]
    fn defaults_are_nixs() {
        assert_eq!(ClientSettings::default().to_words(), [0, 0, 0, 3, 1, 0, 1, 0, 0, 0, 0, 1]);
        let w = [7, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
        assert_eq!(ClientSettings::from_words(w).to_words(), [1, 0, 1, 2, 3, 4, 1, 6, 7, 8, 9, 1], "flags are read as non-zero");
    }
}
