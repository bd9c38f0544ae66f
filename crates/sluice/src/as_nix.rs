//! `--as-nix VERSION`: which Nix version's output a command reproduces where Nix 2.8's and
//! Nix 2.26's differ (`path-info --json` and `-h`, `nar ls` paths and `--json`).

/// A Nix version whose output sluice reproduces byte for byte.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum NixVersion {
    /// Nix 2.8 (Debian 12's `nix-bin`).
    #[value(name = "2.8")]
    V2_8,
    /// Nix 2.26, whose output every Nix since 2.19 shares for these commands.
    #[value(name = "2.26")]
    V2_26,
}
