//! A connection's settings, as the client's SetOptions leaves them (Nix
//! `ClientSettings::apply` in `daemon.cc`; the operation is `ops::options`). Overrides apply on
//! top of the daemon's own settings; an untrusted client may only set a few harmless ones and `substituters` (or its
//! alias `binary-caches`) to daemon-trusted ones, and is warned (as Nix ≥ 2.13 warns; 2.8 only
//! logged it at debug level) about everything else it tried. See `docs/daemon-trust.md`.

use std::cell::OnceCell;
use std::sync::Arc;

use sluice_nix::signature::TrustedKeys;
use sluice_nix::wire::ops::{ClientSettings, SetOptions};
use sluice_store::config::{setting_of, RawConfig, Settings};

use crate::conn::Fail;
use crate::Daemon;

/// Settings an untrusted client may still change, by the exact name Nix compares
/// (`settings.buildTimeout.name` is `timeout`, so the alias `build-timeout` is restricted, as
/// in Nix): Nix 2.8's `timeout`, `repeat` and `connect-timeout`, and 2.26's `max-silent-time`
/// and `poll-interval` (2.26 dropped `repeat`). `builders` may also be set, to the empty
/// string only. A real Nix client sends each setting under its own name, not an alias.
const UNPRIVILEGED: [&str; 5] = ["timeout", "repeat", "max-silent-time", "poll-interval", "connect-timeout"];
/// Settings never taken from clients: they describe the client's side or the daemon itself.
const IGNORED: [&str; 4] = ["experimental-features", "extra-experimental-features", "ssh-auth-sock", "store"];
/// Accepted overrides that are not forwarded to the Nix daemon of `--build-via` (by the
/// setting they set, aliases and `extra-` resolved): the substitution settings (sluice has
/// substituted, and asks the Nix daemon not to), and what Nix's own client leaves out of its
/// SetOptions besides the numeric fields (`remote-store.cc` `setOptions`: `show-trace`,
/// `plugin-files`; `experimental-features` is [`IGNORED`]).
const NOT_FORWARDED: [&str; 7] =
    ["substituters", "trusted-substituters", "trusted-public-keys", "substitute", "builders-use-substitutes", "show-trace", "plugin-files"];

/// One connection's settings.
#[derive(Debug, Clone)]
pub(crate) struct ClientOptions {
    /// The daemon's settings with the accepted overrides (fixed once made: the two below are
    /// made from it).
    raw: RawConfig,
    /// `raw` parsed (or the error naming a bad value), on first use, kept for the connection.
    settings: OnceCell<Result<Arc<Settings>, String>>,
    /// Its `trusted-public-keys` decoded, likewise: every add operation needs them, and
    /// decoding a key (an ed25519 point decompression) took ~43,000 instructions per key per
    /// AddToStore before (callgrind, Nix 2.8's `nix-instantiate` of 1000 derivations).
    trusted_keys: OnceCell<Result<TrustedKeys, String>>,
    /// The numeric settings of the client's SetOptions (Nix's defaults before it sends one):
    /// what a build forwarded to the Nix daemon of `--build-via` is run with.
    pub numeric: ClientSettings,
    /// The overrides accepted from the client (name as sent, value) that a build forwarded
    /// to the Nix daemon of `--build-via` is run with: never one the client could not set
    /// itself, nor a substitution setting ([`NOT_FORWARDED`]).
    pub forwarded: Vec<(String, String)>,
}

impl ClientOptions {
    /// Whether substituters may be used at all (the client's useSubstitutes).
    pub(crate) fn use_substitutes(&self) -> bool {
        self.numeric.use_substitutes
    }

    /// The daemon's own settings, before any SetOptions (the numeric ones Nix's defaults).
    pub(crate) fn new(daemon: &Daemon) -> Self {
        ClientOptions {
            raw: daemon.config.clone(),
            numeric: ClientSettings::default(),
            forwarded: Vec::new(),
            settings: OnceCell::new(),
            trusted_keys: OnceCell::new(),
        }
    }

    /// The typed settings (substituters, keys, timeouts); an error names a bad value.
    pub(crate) fn settings(&self) -> Result<Arc<Settings>, Fail> {
        let settings = self.settings.get_or_init(|| Settings::from_raw(&self.raw).map(Arc::new).map_err(|e| e.to_string()));
        settings.clone().map_err(Fail::Op)
    }

    /// The `trusted-public-keys` (the error `trusted-public-keys: …` names a bad one).
    pub(crate) fn trusted_keys(&self) -> Result<TrustedKeys, Fail> {
        let settings = self.settings()?;
        let keys = self
            .trusted_keys
            .get_or_init(|| TrustedKeys::parse(&settings.trusted_public_keys.join(" ")).map_err(|e| format!("trusted-public-keys: {e}")));
        keys.clone().map_err(Fail::Op)
    }

    /// The settings of a client (`trusted` or not) after its SetOptions `request`, on top of
    /// the daemon's own, and the warnings for the overrides refused.
    pub(crate) fn apply(daemon: &Daemon, trusted: bool, request: SetOptions) -> (Self, Vec<String>) {
        let mut options = ClientOptions::new(daemon);
        options.numeric = request.settings;
        let mut warnings = Vec::new();
        for (name, value) in request.overrides {
            // `binary-caches` is Nix's old alias of `substituters`.
            let name = match name.as_str() {
                "binary-caches" => "substituters".to_owned(),
                "extra-binary-caches" => "extra-substituters".to_owned(),
                _ => name,
            };
            if IGNORED.contains(&name.as_str()) {
                continue;
            }
            if trusted || UNPRIVILEGED.contains(&name.as_str()) || (name == "builders" && value.is_empty()) {
                options.raw.set(&name, &value);
                if !NOT_FORWARDED.contains(&setting_of(&name).1) {
                    options.forwarded.push((name, value));
                }
            } else if name == "substituters" {
                // Nix's `setSubstituters`: the setting itself or an alias, not `extra-substituters`.
                let accepted = trusted_substituters(&daemon.config, &value, &mut warnings);
                options.raw.set("substituters", &accepted.join(" "));
            } else {
                warnings.push(format!(
                    "ignoring the client-specified setting '{name}', because it is a restricted setting and you are not a trusted user"
                ));
            }
        }
        (options, warnings)
    }
}

/// The substituters in `value` that the daemon trusts (its `substituters` and
/// `trusted-substituters`, with or without a trailing slash); a warning for each other one.
fn trusted_substituters(daemon: &RawConfig, value: &str, warnings: &mut Vec<String>) -> Vec<String> {
    let trusted: Vec<&str> =
        ["substituters", "trusted-substituters"].iter().filter_map(|k| daemon.get(k)).flat_map(str::split_whitespace).collect();
    let mut out = Vec::new();
    for s in value.split_whitespace() {
        if trusted.contains(&s) {
            out.push(s.to_owned());
        } else if !s.ends_with('/') && trusted.contains(&format!("{s}/").as_str()) {
            out.push(format!("{s}/"));
        } else {
            warnings.push(format!(
                "ignoring untrusted substituter '{s}', you are not a trusted user.\n\
                 Run `man nix.conf` for more information on the `substituters` configuration option."
            ));
        }
    }
    out
}
