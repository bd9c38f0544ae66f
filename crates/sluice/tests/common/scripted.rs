//! The cases' scriptable loopback HTTP server (`server.py` of cases 10, 12 and 13): started on
//! a free port (or a given one), with optional JSON rules, logging every request; killed on drop.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::shared;

/// A running `server.py`.
pub struct Scripted {
    pub url: String,
    pub port: u16,
    pub log: PathBuf,
    child: Child,
}

impl Scripted {
    /// Serves `root` with `rules` (a JSON file, if any) on `port` (0: a free one); the request
    /// log goes to `log`.
    pub fn start(root: &Path, rules: Option<&Path>, port: u16, log: &Path) -> Scripted {
        let script = shared().join("cases/10-http-403-401-404/server.py");
        let mut cmd = Command::new("python3");
        cmd.arg(script).args(["--root", root.to_str().unwrap(), "--port", &port.to_string(), "--log", log.to_str().unwrap()]);
        if let Some(r) = rules {
            cmd.args(["--rules", r.to_str().unwrap()]);
        }
        let (child, port) = launch(cmd);
        Scripted { url: format!("http://127.0.0.1:{port}"), port, log: log.to_path_buf(), child }
    }

    /// Logged requests `(method, path, status)` whose path matches `pred`.
    pub fn requests(&self, pred: impl Fn(&str) -> bool) -> Vec<(String, String, u16)> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .map(|v| {
                (
                    v["method"].as_str().unwrap_or("").to_string(),
                    v["path"].as_str().unwrap_or("").to_string(),
                    v["status"].as_u64().unwrap_or(0) as u16,
                )
            })
            .filter(|(_, p, _)| pred(p))
            .collect()
    }
}

impl Drop for Scripted {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a server script that prints `PORT <n>` once it listens: the process and the port.
pub fn launch(mut cmd: Command) -> (Child, u16) {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn().expect("python3 runs the server script");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let port = line.trim().strip_prefix("PORT ").and_then(|p| p.parse().ok());
    let Some(port) = port else {
        let _ = child.kill();
        panic!("the server script said {line:?}");
    };
    (child, port)
}

/// A loopback port nothing listens on (bound, then released).
pub fn closed_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}
