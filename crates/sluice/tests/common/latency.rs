//! `shared/bin/latency-proxy` in front of a loopback port: every connection through it pays
//! the round-trip time (its model: a fresh plain HTTP request costs 2 RTT, over TLS 1.3 3 RTT,
//! a request on a kept-alive connection 1). Stopped on drop.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{closed_port, shared};

/// A running latency-proxy.
pub struct LatencyProxy {
    /// The port it listens on, on 127.0.0.1.
    pub port: u16,
    child: Child,
}

impl LatencyProxy {
    /// Proxies a free loopback port to 127.0.0.1:`upstream` at `rtt_ms`.
    pub fn start(upstream: u16, rtt_ms: u32) -> LatencyProxy {
        let port = closed_port();
        let child = Command::new(shared().join("bin/latency-proxy"))
            .args(["--listen", &format!("127.0.0.1:{port}"), "--upstream", &format!("127.0.0.1:{upstream}")])
            .args(["--rtt-ms", &rtt_ms.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_for_port(port, "latency-proxy");
        LatencyProxy { port, child }
    }
}

impl Drop for LatencyProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until something accepts connections on 127.0.0.1:`port`.
pub fn wait_for_port(port: u16, what: &str) {
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what} did not start on port {port}");
}
