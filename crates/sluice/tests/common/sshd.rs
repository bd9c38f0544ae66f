//! A real OpenSSH server on 127.0.0.1 for the SSH store tests: its own host key, client key,
//! `authorized_keys`, `sshd_config` and client `ssh_config` under the test's directory, touching
//! no system file (sshd runs in a private mount namespace with its own empty `/run`, where it
//! wants `/run/sshd`). Optionally behind `shared/bin/latency-proxy`. Stopped on drop.

use super::latency::wait_for_port;
use super::{check, closed_port, LatencyProxy};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The host alias the client configuration gives the server: `ssh-ng://sluice-test`.
pub const HOST: &str = "sluice-test";

/// A running sshd and the client configuration that reaches it.
pub struct Sshd {
    /// The directory of keys and configuration files.
    pub dir: PathBuf,
    /// The port sshd listens on.
    pub port: u16,
    child: Child,
    proxy: Option<LatencyProxy>,
}

impl Sshd {
    /// Starts sshd under `tmp/sshd`, logging in as root with a key of its own.
    pub fn start(tmp: &Path) -> Sshd {
        let dir = tmp.join("sshd");
        std::fs::create_dir_all(&dir).unwrap();
        for key in ["host_key", "client_key"] {
            let o = Command::new("ssh-keygen").args(["-q", "-t", "ed25519", "-N", "", "-f"]).arg(dir.join(key)).output().unwrap();
            check(&o, "ssh-keygen (install Debian's openssh-client)");
        }
        std::fs::copy(dir.join("client_key.pub"), dir.join("authorized_keys")).unwrap();
        let port = closed_port();
        let d = dir.display();
        std::fs::write(
            dir.join("sshd_config"),
            format!(
                "ListenAddress 127.0.0.1:{port}\nHostKey {d}/host_key\nAuthorizedKeysFile {d}/authorized_keys\n\
                 PidFile {d}/sshd.pid\nStrictModes no\nUsePAM no\nPasswordAuthentication no\n\
                 KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
            ),
        )
        .unwrap();
        let host_key = std::fs::read_to_string(dir.join("host_key.pub")).unwrap();
        std::fs::write(dir.join("known_hosts"), format!("{HOST} {host_key}")).unwrap();
        let log = std::fs::File::create(dir.join("sshd.log")).unwrap();
        let script = format!("mount -t tmpfs none /run && mkdir /run/sshd && exec /usr/sbin/sshd -D -e -f {d}/sshd_config");
        let child = Command::new("unshare")
            .args(["--mount", "sh", "-c", &script])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run sshd (install Debian's openssh-server): {e}"));
        let mut sshd = Sshd { dir, port, child, proxy: None };
        sshd.write_client_config(port);
        wait_for_port(port, "sshd");
        sshd
    }

    /// Puts `shared/bin/latency-proxy --rtt-ms rtt_ms` between the client configuration and
    /// sshd: every connection through [`HOST`] then pays the round-trip time.
    pub fn with_rtt(mut self, rtt_ms: u32) -> Sshd {
        let proxy = LatencyProxy::start(self.port, rtt_ms);
        self.write_client_config(proxy.port);
        self.proxy = Some(proxy);
        self
    }

    /// The client configuration file: `ssh -F <this> sluice-test` logs in.
    pub fn ssh_config(&self) -> PathBuf {
        self.dir.join("ssh_config")
    }

    /// `NIX_SSHOPTS` that make Nix's and sluice's `ssh` use [`Sshd::ssh_config`].
    pub fn ssh_opts(&self) -> String {
        format!("-F {}", self.ssh_config().display())
    }

    /// sshd's log (`-e`): authentication and session lines.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("sshd.log")).unwrap_or_default()
    }

    /// Writes the client configuration that reaches [`HOST`] on `port` (sshd's, or a proxy's).
    fn write_client_config(&mut self, port: u16) {
        let d = self.dir.display();
        std::fs::write(
            self.ssh_config(),
            format!(
                "Host {HOST}\n  HostName 127.0.0.1\n  Port {port}\n  User root\n  IdentityFile {d}/client_key\n  \
                 IdentitiesOnly yes\n  HostKeyAlias {HOST}\n  UserKnownHostsFile {d}/known_hosts\n  \
                 StrictHostKeyChecking yes\n  BatchMode yes\n"
            ),
        )
        .unwrap();
    }
}

impl Drop for Sshd {
    fn drop(&mut self) {
        self.proxy = None;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
