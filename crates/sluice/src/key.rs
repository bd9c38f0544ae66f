//! `sluice key`: ed25519 signing keys in Nix's format (`nix key generate-secret`,
//! `nix key convert-secret-to-public`).

use std::io::Read;
use std::process::ExitCode;

use sluice_nix::signature::SecretKey;

/// `sluice key` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Print a new secret key `NAME:base64`; with `--public`, read a secret key on standard
    /// input and print its public key instead.
    Generate {
        /// The key name, e.g. `cache.example.org-1`.
        #[arg(required_unless_present = "public")]
        name: Option<String>,
        /// Derive the public key of the secret key read from standard input.
        #[arg(long)]
        public: bool,
    },
}

/// Runs a `sluice key` subcommand.
pub fn run(cmd: Command) -> Result<ExitCode, String> {
    let Command::Generate { name, public } = cmd;
    if public {
        let mut text = String::new();
        std::io::stdin().read_to_string(&mut text).map_err(|e| format!("reading the secret key: {e}"))?;
        let key = SecretKey::parse(text.trim()).map_err(|e| e.to_string())?;
        println!("{}", key.to_public());
    } else {
        let name = name.unwrap_or_default();
        if name.is_empty() || name.contains(':') {
            return Err(format!("invalid key name {name:?}: it must be non-empty and contain no ':'"));
        }
        private_output();
        println!("{}", SecretKey::generate(&name));
    }
    Ok(ExitCode::SUCCESS)
}

/// Makes standard output, when it is a file (`sluice key generate NAME > key.sec`), readable by
/// its owner only, as Nix writes secret keys (`nix-store --generate-binary-cache-key`, mode
/// 0600); warns when it cannot.
fn private_output() {
    use std::os::fd::AsFd;
    use std::os::unix::fs::PermissionsExt;
    let Ok(fd) = std::io::stdout().as_fd().try_clone_to_owned() else { return };
    let file = std::fs::File::from(fd);
    let Ok(meta) = file.metadata() else { return };
    if meta.is_file() && meta.permissions().mode() & 0o077 != 0 {
        if let Err(e) = file.set_permissions(std::fs::Permissions::from_mode(0o600)) {
            crate::log::Log::get().msg(
                crate::log::LVL_WARN,
                &format!(
                    "warning: the secret key goes to a file others may read (mode {:o}), which cannot be made 0600: {e}",
                    meta.permissions().mode() & 0o777
                ),
            );
        }
    }
}
