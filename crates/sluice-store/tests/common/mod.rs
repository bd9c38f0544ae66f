//! Helpers shared by the modules of the integration binary.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Component, Path, PathBuf};

/// An HTTP/1.1 server in this process over a directory, enough for a binary cache and for an
/// S3 bucket addressed by path (`/BUCKET/KEY`, requests unsigned): `GET`, `HEAD` and `PUT` of
/// files (a body by `Content-Length` or chunked), connections kept alive. Other methods get
/// 405. Its threads end with the test process.
pub struct DirServer {
    /// `http://127.0.0.1:PORT`.
    pub url: String,
}

impl DirServer {
    pub fn start(dir: &Path) -> DirServer {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let dir = dir.to_owned();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let dir = dir.clone();
                std::thread::spawn(move || serve(conn, &dir));
            }
        });
        DirServer { url }
    }
}

/// Answers the requests of one connection until it closes or a request is malformed.
fn serve(conn: TcpStream, dir: &Path) {
    let Ok(mut out) = conn.try_clone() else { return };
    let mut input = BufReader::new(conn);
    while let Some((method, file, body)) = request(&mut input, dir) {
        let (status, reply) = match (method.as_str(), file) {
            (_, None) => ("400 Bad Request", None),
            ("GET" | "HEAD", Some(file)) => match std::fs::read(file) {
                Ok(bytes) => ("200 OK", Some(bytes)),
                Err(_) => ("404 Not Found", None),
            },
            ("PUT", Some(file)) => {
                let written = file.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|()| std::fs::write(&file, body));
                (if written.is_ok() { "200 OK" } else { "500 Internal Server Error" }, None)
            }
            _ => ("405 Method Not Allowed", None),
        };
        let length = reply.as_ref().map_or(0, Vec::len);
        let mut response = format!("HTTP/1.1 {status}\r\nContent-Length: {length}\r\n\r\n").into_bytes();
        if method != "HEAD" {
            response.extend(reply.unwrap_or_default());
        }
        if out.write_all(&response).is_err() {
            return;
        }
    }
}

/// The next request: its method, the file under `dir` its path names (`None` for a path
/// that leaves `dir`) and its body.
fn request(input: &mut BufReader<TcpStream>, dir: &Path) -> Option<(String, Option<PathBuf>, Vec<u8>)> {
    let first = line(input)?;
    let mut words = first.split_whitespace();
    let (method, target) = (words.next()?.to_string(), words.next()?);
    let rel = Path::new(target.split('?').next()?.trim_start_matches('/'));
    let file = rel.components().all(|c| matches!(c, Component::Normal(_))).then(|| dir.join(rel));
    let (mut length, mut chunked) = (0, false);
    loop {
        let header = line(input)?;
        if header.is_empty() {
            break;
        }
        let (name, value) = header.split_once(':')?;
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => length = value.trim().parse().ok()?,
            "transfer-encoding" => chunked = value.trim().eq_ignore_ascii_case("chunked"),
            _ => {}
        }
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            let size = usize::from_str_radix(line(input)?.split(';').next()?.trim(), 16).ok()?;
            if size == 0 {
                while !line(input)?.is_empty() {}
                break;
            }
            let start = body.len();
            body.resize(start + size, 0);
            input.read_exact(&mut body[start..]).ok()?;
            line(input)?;
        }
    } else {
        body.resize(length, 0);
        input.read_exact(&mut body).ok()?;
    }
    Some((method, file, body))
}

/// One line without its CRLF; `None` at the end of the connection.
fn line(input: &mut BufReader<TcpStream>) -> Option<String> {
    let mut text = String::new();
    match input.read_line(&mut text) {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(text.trim_end_matches(['\r', '\n']).to_string()),
    }
}
