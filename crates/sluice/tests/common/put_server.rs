//! `put_server.py`: a loopback binary cache that takes uploads (`PUT`), with optional rules that
//! delay, fail or cut off requests, a listen backlog of the test's choice, and a log of every
//! request (when it was read and answered) and connection; killed on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};

use super::scripted::launch;

/// A running `put_server.py`.
pub struct PutServer {
    pub url: String,
    pub log: PathBuf,
    child: Child,
}

/// One logged request.
#[derive(Debug, Clone)]
pub struct Logged {
    pub method: String,
    pub path: String,
    /// 0 for a connection closed unanswered.
    pub status: u16,
    /// Seconds since the epoch when the request was read, and when it was answered.
    pub received: f64,
    pub answered: f64,
}

impl PutServer {
    /// Serves and stores under `root` with `rules` (JSON text, `[]` for none), a listen queue of
    /// `backlog`, HTTP/1.1 keep-alive if `keep_alive`; the log goes to `dir/put-server.log`.
    pub fn start(root: &Path, dir: &Path, rules: &str, backlog: u32, keep_alive: bool) -> PutServer {
        let (rules_file, log) = (dir.join("put-server-rules.json"), dir.join("put-server.log"));
        std::fs::write(&rules_file, rules).unwrap();
        let mut cmd = Command::new("python3");
        cmd.arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/common/put_server.py"))
            .args(["--root", root.to_str().unwrap(), "--log", log.to_str().unwrap(), "--rules", rules_file.to_str().unwrap()])
            .args(["--backlog", &backlog.to_string()]);
        if keep_alive {
            cmd.arg("--keep-alive");
        }
        let (child, port) = launch(cmd);
        PutServer { url: format!("http://127.0.0.1:{port}"), log, child }
    }

    fn entries(&self) -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect()
    }

    /// The logged requests, in the order they were answered.
    pub fn requests(&self) -> Vec<Logged> {
        self.entries()
            .into_iter()
            .filter(|v| v["method"] != "CONNECT")
            .map(|v| Logged {
                method: v["method"].as_str().unwrap().to_string(),
                path: v["path"].as_str().unwrap().to_string(),
                status: v["status"].as_u64().unwrap() as u16,
                received: v["received"].as_f64().unwrap(),
                answered: v["answered"].as_f64().unwrap(),
            })
            .collect()
    }

    /// `(connections accepted, most open at once)`.
    pub fn connections(&self) -> (usize, u64) {
        let opened: Vec<u64> = self.entries().iter().filter(|v| v["method"] == "CONNECT").map(|v| v["open"].as_u64().unwrap()).collect();
        (opened.len(), opened.iter().copied().max().unwrap_or(0))
    }
}

impl Drop for PutServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
