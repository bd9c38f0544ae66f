//! The SSH stores (`ssh-ng://`, `ssh://`) against a real sshd on 127.0.0.1 ([`common::sshd`]).

use std::process::Command;

use crate::common::check;
use crate::common::sshd::{Sshd, HOST};

/// The harness itself: the test's own keys and configuration log in, and nothing else does.
#[test]
fn sshd_logs_in_with_the_tests_key_only() {
    let tmp = tempfile::tempdir().unwrap();
    let sshd = Sshd::start(tmp.path());
    let o = Command::new("ssh").arg("-F").arg(sshd.ssh_config()).args([HOST, "echo", "logged-in"]).output().unwrap();
    check(&o, "ssh through the test's configuration");
    assert_eq!(String::from_utf8_lossy(&o.stdout), "logged-in\n");
    let o = Command::new("ssh")
        .args(["-F", "/dev/null", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null"])
        .args(["-i", "/dev/null", "-p", &sshd.port.to_string(), "root@127.0.0.1", "true"])
        .output()
        .unwrap();
    assert!(!o.status.success(), "a client without the test's key logged in");
}
