//! Commands on a remote host through the system's `ssh`, for the SSH stores (`ssh-ng://`,
//! `ssh://`): Nix's `SSHMaster` (`src/libstore/ssh.cc`) and `CommonSSHStoreConfig`
//! (`common-ssh-store-config.cc`, Nix 2.26). The system's `ssh` is run, so that
//! `~/.ssh/config`, agents and `ControlMaster` work as they do for the user: `ssh
//! [user@]host -x` with `$NIX_SSHOPTS` (split as a shell splits words), `-i` for `ssh-key`,
//! `-oUserKnownHostsFile=` a file holding `base64-ssh-public-host-key`, `-C` for `compress`,
//! `-p` for a port, then `--` and the remote command. As Nix does, ssh runs `echo started`
//! locally once the connection is up (`-oLocalCommand`), so that ssh's own failures (host key,
//! authentication) are told apart from the remote command's; and `localhost` (no user, no
//! port) runs the command here, without ssh.
//!
//! ssh's standard error is kept (its last lines, and logged at debug level): when the stream
//! from the remote command ends early or writing to it fails, the reader and writer of
//! [`SshChannel`] wait for ssh and fail with one error naming the host and saying why (ssh's
//! message, or the remote command's exit status and message: 127 for a missing program).
//!
//! A channel may be given a stall limit ([`SshChannel::give_up_after`]; both SSH stores give it
//! `stalled-download-timeout`): a read or write that waits that long while no byte moved
//! either way fails, naming the host, instead of waiting for ever on a far end that stopped.
//!
//! | parameter | Nix source | in sluice |
//! |---|---|---|
//! | `ssh-key` | `common-ssh-store-config.hh` | `-i` |
//! | `base64-ssh-public-host-key` | same | the only known host key (`-oUserKnownHostsFile=`) |
//! | `compress` | same | `-C` |
//! | `remote-store` | same | `--store` for the remote command |
//! | `remote-program` | `ssh-store.hh`, `legacy-ssh-store.hh` | the remote command's words (split at white space) |
//! | `max-connections` | `remote-store.hh`, `legacy-ssh-store.hh` | accepted, no effect (one connection) |

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use base64::Engine;

use crate::store_url::{Param, ParamType, Query, StoreUrlError};

/// The parameters every SSH store takes (Nix's `CommonSSHStoreConfig` with `remote-program`
/// and `max-connections`, which both SSH stores have).
pub(crate) const SSH_PARAMS: &[Param] = &[
    ("ssh-key", ParamType::Path),
    ("base64-ssh-public-host-key", ParamType::Text),
    ("compress", ParamType::Bool),
    ("remote-store", ParamType::Text),
    ("remote-program", ParamType::Text),
    ("max-connections", ParamType::Int),
];

/// Bytes of ssh's standard error kept for error messages (the last ones).
const STDERR_KEPT: usize = 4096;

/// Lines of ssh's standard error an error message quotes (the last ones).
const STDERR_LINES: usize = 3;

/// Where and how to reach a host: an SSH store's URL authority and parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SshConfig {
    /// The user to log in as (`user@`), else ssh's default.
    pub user: Option<String>,
    /// The host name (or address; `[::1]` is given to ssh as `::1`).
    pub host: String,
    /// The port (`:port`), else ssh's default.
    pub port: Option<u16>,
    /// `ssh-key`: the private key file.
    pub key: Option<PathBuf>,
    /// `base64-ssh-public-host-key`, decoded: the host's public key line (`ssh-ed25519 AAAA…`).
    pub public_host_key: Option<String>,
    /// `compress`: ssh's `-C`.
    pub compress: bool,
    /// `remote-program`, split at white space (Nix's `Strings` setting).
    pub remote_program: Vec<String>,
    /// `remote-store`: the store URL the remote program is given with `--store`.
    pub remote_store: Option<String>,
}

/// Why ssh could not run the remote command. Each names the host.
#[derive(Debug, thiserror::Error)]
pub enum SshError {
    /// `ssh` (or, for `localhost`, the command) could not be started.
    #[error("cannot run '{program}' to reach '{host}': {source}")]
    Spawn {
        host: String,
        program: String,
        #[source]
        source: std::io::Error,
    },
    /// The file of the known host key could not be written.
    #[error("writing the known host key of '{host}' to {path}: {source}")]
    HostKeyFile {
        host: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// ssh did not connect (ssh's message: host key verification, authentication, …).
    #[error("failed to start SSH connection to '{host}': {stderr}")]
    Connect { host: String, stderr: String },
    /// The remote command (or ssh) ended while it was being talked to.
    #[error("SSH connection to '{host}': {command:?} {status}{stderr}")]
    Ended { host: String, command: String, status: String, stderr: String },
}

impl SshConfig {
    /// Parses the authority of `url` (`main` without its scheme `scheme://`, no path) and takes
    /// the SSH parameters of `q`; `remote-program` defaults to `default_program`. Nix's
    /// `extractConnStr` and `checkValidAuthority`.
    pub(crate) fn parse(url: &str, main: &str, scheme: &str, q: &mut Query<'_>, default_program: &str) -> Result<Self, StoreUrlError> {
        let authority = main.strip_prefix(scheme).and_then(|m| m.strip_prefix("://")).unwrap_or("");
        let bad = |reason| StoreUrlError::BadParam { url: url.to_string(), param: "host".into(), value: authority.to_string(), reason };
        if authority.contains('/') {
            return Err(bad("an SSH store's URL is scheme://[user@]host[:port], with no path"));
        }
        let (user, host_port) = match authority.rsplit_once('@') {
            Some((user, rest)) => (Some(user.to_string()), rest),
            None => (None, authority),
        };
        let (host, port) = match host_port.strip_prefix('[') {
            Some(v6) => {
                let (host, rest) = v6.split_once(']').ok_or_else(|| bad("an IPv6 address in [ ] has no ]"))?;
                (host, rest.strip_prefix(':'))
            }
            None => match host_port.rsplit_once(':') {
                Some((host, port)) if !host.contains(':') => (host, Some(port)),
                _ => (host_port, None),
            },
        };
        let port = port.map(|p| p.parse::<u16>().map_err(|_| bad("the port is not a number from 0 to 65535"))).transpose()?;
        match &user {
            Some(u) if u.is_empty() => return Err(bad("the user name is empty")),
            Some(u) if u.starts_with('-') => return Err(bad("the user name starts with '-'")),
            _ => {}
        }
        if host.is_empty() {
            return Err(bad("the host name is empty"));
        }
        if host.starts_with('-') {
            return Err(bad("the host name starts with '-'"));
        }
        let key = q.take("ssh-key").map(|v| q.path("ssh-key", &v)).transpose()?;
        let public_host_key = match q.take("base64-ssh-public-host-key").filter(|v| !v.is_empty()) {
            Some(v) => {
                let decoded = base64::engine::general_purpose::STANDARD.decode(v.trim()).ok().and_then(|b| String::from_utf8(b).ok());
                Some(decoded.ok_or_else(|| q.bad("base64-ssh-public-host-key", &v, "not the base64 of a public key line"))?)
            }
            None => None,
        };
        let compress = q.take_bool("compress")?.unwrap_or(false);
        let remote_program = match q.take("remote-program") {
            Some(v) if !v.trim().is_empty() => v.split_whitespace().map(str::to_string).collect(),
            Some(v) => return Err(q.bad("remote-program", &v, "the remote program cannot be empty")),
            None => vec![default_program.to_string()],
        };
        let remote_store = q.take("remote-store").filter(|v| !v.is_empty());
        Ok(SshConfig { user, host: host.to_string(), port, key, public_host_key, compress, remote_program, remote_store })
    }

    /// `[user@]host`, as ssh is given it and errors name it.
    pub fn destination(&self) -> String {
        match &self.user {
            Some(user) => format!("{user}@{}", self.host),
            None => self.host.clone(),
        }
    }

    /// The remote command: `remote-program`, then `args` quoted for the remote shell (ssh
    /// joins its arguments into one line that the remote user's shell parses), then
    /// `--store <remote-store>` when one is given (Nix's `SSHStore::openConnection`).
    pub fn remote_command(&self, args: &[&str]) -> Vec<String> {
        let store = self.remote_store.iter().flat_map(|s| ["--store", s.as_str()]);
        let quoted = args.iter().copied().chain(store).map(|a| shlex::try_quote(a).map_or_else(|_| a.to_string(), |q| q.into_owned()));
        self.remote_program.iter().cloned().chain(quoted).collect()
    }
}

/// A host reached through the system's `ssh` (Nix's `SSHMaster`): commands started on it
/// ([`SshMaster::start`]). Holds the temporary directory of the known host key file.
#[derive(Debug)]
pub struct SshMaster {
    config: SshConfig,
    /// Nix's `fakeSSH`: `localhost` runs commands here.
    local: bool,
    /// The temporary directory holding `host-key` when `base64-ssh-public-host-key` is given.
    known_hosts: Option<(tempfile::TempDir, PathBuf)>,
    /// `$NIX_SSHOPTS`, split.
    nix_sshopts: Vec<String>,
}

impl SshMaster {
    /// A master for `config`: writes the known host key, if given, into a temporary file and
    /// splits `$NIX_SSHOPTS` (as Nix's `shellSplitString`; malformed quoting is an error).
    pub fn new(config: SshConfig) -> Result<Self, SshError> {
        let local = config.user.is_none() && config.port.is_none() && config.host == "localhost";
        let opts = std::env::var("NIX_SSHOPTS").unwrap_or_default();
        let nix_sshopts = shlex::split(&opts).ok_or_else(|| SshError::Connect {
            host: config.host.clone(),
            stderr: format!("NIX_SSHOPTS {opts:?} has unbalanced quotes or a trailing backslash"),
        })?;
        let known_hosts = match &config.public_host_key {
            Some(key) => {
                let host = &config.host;
                let err = |path: PathBuf| move |source| SshError::HostKeyFile { host: host.clone(), path, source };
                let dir = tempfile::Builder::new().prefix("sluice-ssh").tempdir().map_err(err(std::env::temp_dir()))?;
                let file = dir.path().join("host-key");
                std::fs::write(&file, format!("{host} {}\n", key.trim_end())).map_err(err(file.clone()))?;
                Some((dir, file))
            }
            None => None,
        };
        Ok(SshMaster { config, local, known_hosts, nix_sshopts })
    }

    /// The host's configuration.
    pub fn config(&self) -> &SshConfig {
        &self.config
    }

    /// The `ssh` command line that runs `command` on the host (after `--`).
    fn ssh_command(&self, command: &[String]) -> Command {
        if self.local {
            // The line a remote shell would parse, parsed by one here (Nix's `fakeSSH` runs
            // `bash -c`), so that the arguments quoted for it arrive whole; the shell becomes
            // the command, so that the command's end of its output is the channel's.
            let mut cmd = Command::new("sh");
            cmd.arg("-c").arg(format!("exec {}", command.join(" ")));
            return cmd;
        }
        let mut cmd = Command::new("ssh");
        cmd.arg(self.config.destination()).arg("-x").args(&self.nix_sshopts);
        if let Some(key) = &self.config.key {
            cmd.arg("-i").arg(key);
        }
        if let Some((_, file)) = &self.known_hosts {
            cmd.arg(format!("-oUserKnownHostsFile={}", file.display()));
        }
        if self.config.compress {
            cmd.arg("-C");
        }
        if let Some(port) = self.config.port {
            cmd.arg(format!("-p{port}"));
        }
        // ssh runs this here once it is connected: its own failures end before "started".
        cmd.args(["-oPermitLocalCommand=yes", "-oLocalCommand=echo started", "--"]).args(command).env("SHELL", "/bin/sh");
        cmd
    }

    /// Runs `command` (a program and its arguments, as [`SshConfig::remote_command`] makes
    /// them) on the host, its standard input and output piped to the returned channel; waits
    /// until ssh is connected (ssh's failure to connect is the error).
    pub fn start(&self, command: &[String]) -> Result<SshChannel, SshError> {
        let host = self.config.host.clone();
        let mut cmd = self.ssh_command(command);
        let program = cmd.get_program().to_string_lossy().into_owned();
        let spawn_err = |source| SshError::Spawn { host: host.clone(), program: program.clone(), source };
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().map_err(spawn_err)?;
        let (Some(stdin), Some(mut stdout), Some(stderr)) = (child.stdin.take(), child.stdout.take(), child.stderr.take()) else {
            return Err(spawn_err(std::io::Error::other("its standard streams were not piped")));
        };
        let kept = Arc::new(Mutex::new(Vec::new()));
        let collector = {
            let kept = kept.clone();
            std::thread::Builder::new().name("sluice-ssh-stderr".into()).spawn(move || collect_stderr(stderr, &kept)).map_err(spawn_err)?
        };
        let session = Arc::new(Session {
            host: host.clone(),
            command: command.join(" "),
            child: Mutex::new(child),
            kept,
            collector: Mutex::new(Some(collector)),
            stall: OnceLock::new(),
            moved: Mutex::new(Instant::now()),
        });
        if !self.local && first_line(&mut stdout).as_deref() != Some("started") {
            session.wait();
            return Err(SshError::Connect { host, stderr: session.stderr().unwrap_or_else(|| "ssh ended without a message".into()) });
        }
        Ok(SshChannel { reader: SshReader { stdout, session: session.clone() }, writer: SshWriter { stdin, session } })
    }
}

/// Reads one line (without its newline), byte by byte so that nothing after it is consumed;
/// `None` at the end of the stream or on an error.
fn first_line(r: &mut impl Read) -> Option<String> {
    let mut line = Vec::new();
    let mut byte = [0u8];
    loop {
        match r.read(&mut byte) {
            Ok(1) if byte[0] == b'\n' => return String::from_utf8(line).ok(),
            Ok(1) if line.len() < 1024 => line.push(byte[0]),
            _ => return None,
        }
    }
}

/// Reads ssh's standard error to its end, logging each line and keeping the last
/// [`STDERR_KEPT`] bytes in `kept`. A line is read [`STDERR_KEPT`] bytes at most at a time:
/// a far end writing no newline holds no more memory.
fn collect_stderr(stderr: std::process::ChildStderr, kept: &Mutex<Vec<u8>>) {
    let mut lines = std::io::BufReader::new(stderr);
    let mut line = Vec::new();
    while matches!(std::io::BufRead::read_until(&mut (&mut lines).take(STDERR_KEPT as u64), b'\n', &mut line), Ok(n) if n > 0) {
        tracing::debug!("ssh: {}", String::from_utf8_lossy(&line).trim_end());
        let mut kept = kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.extend_from_slice(&line);
        let excess = kept.len().saturating_sub(STDERR_KEPT);
        kept.drain(..excess);
        line.clear();
    }
}

/// A running ssh: its process and what it wrote on standard error. Once the channel's reader
/// and writer are both gone (its input closed), given [`EXIT_GRACE`] to end, then killed.
struct Session {
    host: String,
    command: String,
    child: Mutex<Child>,
    kept: Arc<Mutex<Vec<u8>>>,
    collector: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The stall limit, if one was given ([`SshChannel::give_up_after`]).
    stall: OnceLock<Duration>,
    /// When a byte last moved either way.
    moved: Mutex<Instant>,
}

impl Session {
    /// Notes that bytes moved.
    fn moved(&self) {
        *self.moved.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// Waits until `fd` is ready for `events`, or fails once the stall limit passed since this
    /// wait began and since a byte last moved either way; at once without a limit.
    fn ready(&self, fd: BorrowedFd<'_>, events: rustix::event::PollFlags) -> std::io::Result<()> {
        let Some(limit) = self.stall.get().copied() else { return Ok(()) };
        let began = Instant::now();
        loop {
            let moved = *self.moved.lock().unwrap_or_else(|p| p.into_inner());
            let left = limit.saturating_sub(moved.max(began).elapsed());
            if left.is_zero() {
                let status = format!("stalled: nothing moved either way for {} s (stalled-download-timeout)", limit.as_secs());
                let stalled = SshError::Ended { host: self.host.clone(), command: self.command.clone(), status, stderr: String::new() };
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, stalled));
            }
            let mut fds = [rustix::event::PollFd::from_borrowed_fd(fd, events)];
            match rustix::event::poll(&mut fds, i32::try_from(left.as_millis()).unwrap_or(i32::MAX).max(1)) {
                Ok(0) | Err(rustix::io::Errno::INTR) => {}
                Ok(_) => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Waits (up to [`EXIT_GRACE`]) for ssh to exit and for its standard error to be read; its
    /// exit status, `None` if it still runs. A far end that closed a stream and lives on (the
    /// command `localhost` runs here, or what it left holding its standard error) is not
    /// waited for: no stall limit would end that wait.
    fn wait(&self) -> Option<std::process::ExitStatus> {
        let status = exited_within(&mut self.child.lock().unwrap_or_else(|p| p.into_inner()), EXIT_GRACE)?;
        let mut collector = self.collector.lock().unwrap_or_else(|p| p.into_inner());
        let deadline = Instant::now() + EXIT_GRACE;
        while collector.as_ref().is_some_and(|c| !c.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        if let Some(finished) = collector.take_if(|c| c.is_finished()) {
            let _ = finished.join();
        }
        Some(status)
    }

    /// The last [`STDERR_LINES`] lines ssh wrote on standard error (its verdict comes last,
    /// after banners such as the changed-host-key warning), on one line; `None` if none.
    fn stderr(&self) -> Option<String> {
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let text = String::from_utf8_lossy(&kept);
        let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.chars().all(|c| c == '@')).collect();
        let last = &lines[lines.len().saturating_sub(STDERR_LINES)..];
        (!last.is_empty()).then(|| last.join(" "))
    }

    /// The error for a stream that ended early (`cause`: what the reader or writer saw): once
    /// ssh has exited, its status and message.
    fn ended(&self, cause: &str) -> std::io::Error {
        self.failed(self.wait(), cause)
    }

    /// The error for a stream that ended early, ssh having ended with `status` (`None`: it
    /// still runs).
    fn failed(&self, status: Option<std::process::ExitStatus>, cause: &str) -> std::io::Error {
        let status = match status {
            Some(s) if s.code() == Some(127) => "exited with status 127 (the remote program was not found)".to_string(),
            Some(s) if s.code() == Some(255) => "failed (ssh's status 255)".to_string(),
            Some(s) => match s.code() {
                Some(code) => format!("exited with status {code}"),
                None => format!("ended: {s}"),
            },
            None => format!("ended ({cause})"),
        };
        let stderr = self.stderr().map(|s| format!(": {s}")).unwrap_or_default();
        std::io::Error::other(SshError::Ended { host: self.host.clone(), command: self.command.clone(), status, stderr })
    }
}

/// How long a session whose streams are closed is given to end by itself (the remote command
/// sees the end of its input and exits, then ssh) before ssh is killed.
const EXIT_GRACE: Duration = Duration::from_secs(2);

impl Drop for Session {
    fn drop(&mut self) {
        let child = self.child.get_mut().unwrap_or_else(|p| p.into_inner());
        if exited_within(child, EXIT_GRACE).is_none() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The exit status of `child` if it exits within `grace`.
fn exited_within(child: &mut Child, grace: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + grace;
    loop {
        match child.try_wait() {
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Ok(status) => return status,
            Err(_) => return None,
        }
    }
}

/// A command running on a host: its standard output ([`SshReader`]) and input ([`SshWriter`]).
pub struct SshChannel {
    pub reader: SshReader,
    pub writer: SshWriter,
}

impl SshChannel {
    /// From now on, a read or write that has waited `limit` while no byte moved either way
    /// fails (see the module documentation).
    ///
    /// # Errors
    /// The remote command's input cannot be made non-blocking (`fcntl`), so that a write could
    /// block past the limit.
    pub fn give_up_after(&self, limit: Duration) -> std::io::Result<()> {
        let stdin = self.writer.stdin.as_fd();
        rustix::fs::fcntl_setfl(stdin, rustix::fs::fcntl_getfl(stdin)? | rustix::fs::OFlags::NONBLOCK)?;
        let _ = self.reader.session.stall.set(limit);
        Ok(())
    }
}

/// The remote command's standard output. Where it ends, ssh's failure (if it failed) is the
/// read's error.
pub struct SshReader {
    stdout: ChildStdout,
    session: Arc<Session>,
}

impl Read for SshReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.session.ready(self.stdout.as_fd(), rustix::event::PollFlags::IN)?;
        let read = self.stdout.read(buf);
        if matches!(read, Ok(n) if n > 0) {
            self.session.moved();
        }
        match read {
            Ok(0) if !buf.is_empty() => match self.session.wait() {
                Some(status) if status.success() => Ok(0),
                status => Err(self.session.failed(status, "end of its output")),
            },
            Err(e) if e.kind() != std::io::ErrorKind::Interrupted => Err(self.session.ended(&e.to_string())),
            other => other,
        }
    }
}

/// The remote command's standard input. A write that fails (the remote command or ssh ended)
/// fails with ssh's status and message.
pub struct SshWriter {
    stdin: ChildStdin,
    session: Arc<Session>,
}

impl Write for SshWriter {
    /// Under a stall limit the input is non-blocking: as much of `buf` as the pipe takes is
    /// written, and a full pipe is waited on (up to the limit).
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        loop {
            match self.stdin.write(buf) {
                Ok(n) => {
                    self.session.moved();
                    return Ok(n);
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    self.session.ready(self.stdin.as_fd(), rustix::event::PollFlags::OUT)?
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => return Err(e),
                Err(e) => return Err(self.session.ended(&e.to_string())),
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stdin.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kind taking the SSH parameters, for parsing URLs here.
    static TEST_KIND: crate::registry::StoreKind = crate::registry::StoreKind {
        name: "SSH store",
        forms: "ssh-ng://",
        claims: |_| true,
        params: &[SSH_PARAMS],
        parse: |_, _, _| Err(StoreUrlError::Unsupported(String::new())),
    };

    /// The SSH configuration of the `ssh-ng://` URL `url`, or why it is refused.
    fn parse(url: &str) -> Result<SshConfig, StoreUrlError> {
        let (main, query) = url.split_once('?').unwrap_or((url, ""));
        let mut q = Query::parse(url, query, &TEST_KIND)?;
        let config = SshConfig::parse(url, main, "ssh-ng", &mut q, "nix-daemon")?;
        q.finish()?;
        Ok(config)
    }

    fn ssh_config(url: &str) -> SshConfig {
        parse(url).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    #[test]
    fn authority_and_parameters() {
        let key = base64::engine::general_purpose::STANDARD.encode("ssh-ed25519 AAAAC3Nza");
        let c = ssh_config(&format!(
            "ssh-ng://alice@build.example:2222?ssh-key=/k/id&base64-ssh-public-host-key={key}&compress=true&remote-program=/opt/nix/bin/nix-daemon%20-v&remote-store=local%3Froot%3D/r%26state%3D/s&max-connections=4"
        ));
        assert_eq!((c.user.as_deref(), c.host.as_str(), c.port), (Some("alice"), "build.example", Some(2222)));
        assert_eq!(c.key, Some(PathBuf::from("/k/id")));
        assert_eq!(c.public_host_key.as_deref(), Some("ssh-ed25519 AAAAC3Nza"));
        assert!(c.compress);
        // The store URL is quoted for the remote shell: its '&' does not end the command.
        assert_eq!(c.remote_command(&["--stdio"]), ["/opt/nix/bin/nix-daemon", "-v", "--stdio", "--store", "'local?root=/r&state=/s'"]);
        let c = ssh_config("ssh-ng://[::1]:22");
        assert_eq!((c.user, c.host.as_str(), c.port), (None, "::1", Some(22)));
        assert_eq!(ssh_config("ssh-ng://root@::1").host, "::1");
        assert_eq!(ssh_config("ssh-ng://h").remote_command(&["--stdio"]), ["nix-daemon", "--stdio"]);
        for bad in [
            "ssh-ng://",
            "ssh-ng://-oProxyCommand=x",
            "ssh-ng://-u@h",
            "ssh-ng://@h",
            "ssh-ng://h:port",
            "ssh-ng://h/path",
            "ssh-ng://h?remote-program=",
        ] {
            assert!(parse(bad).is_err(), "{bad} was accepted");
        }
        let e = parse("ssh-ng://h?base64-ssh-public-host-key=@@").unwrap_err().to_string();
        assert!(e.contains("base64-ssh-public-host-key") && e.contains("ssh-ng://h"), "{e}");
    }

    /// `localhost` runs the command here: its output is read, the arguments quoted for the
    /// remote shell arrive whole (a `remote-store=` with `?` and `&`), and a missing
    /// program's end is an error naming the host.
    #[test]
    fn localhost_runs_the_command_here_and_reports_its_failure() {
        let config = ssh_config("ssh-ng://localhost?remote-program=printf%20[%25s]&remote-store=local%3Froot%3D/r%26state%3D/s%20x");
        let master = SshMaster::new(config.clone()).unwrap();
        let mut channel = master.start(&config.remote_command(&["--stdio"])).unwrap();
        let mut out = String::new();
        channel.reader.read_to_string(&mut out).unwrap();
        assert_eq!(out, "[--stdio][--store][local?root=/r&state=/s x]");
        let mut channel = master.start(&["sh".into(), "-c".into(), "'read x; echo got $x'".into()]).unwrap();
        channel.writer.write_all(b"hello\n").unwrap();
        let mut out = String::new();
        channel.reader.read_to_string(&mut out).unwrap();
        assert_eq!(out, "got hello\n");
        let mut channel = master.start(&["sh".into(), "-c".into(), "'echo no such program >&2; exit 127'".into()]).unwrap();
        let e = channel.reader.read(&mut [0u8; 8]).unwrap_err().to_string();
        assert!(e.contains("'localhost'") && e.contains("status 127") && e.contains("no such program"), "{e}");
    }
}
