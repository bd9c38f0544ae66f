#!/usr/bin/env python3
"""A binary cache that takes uploads, for the push tests (loopback only).

usage: put_server.py --root DIR [--port 0] [--log requests.jsonl] [--rules rules.json]
                     [--backlog N] [--keep-alive]

Prints "PORT <n>" once listening. GET and HEAD serve the files under --root (404 if
missing); PUT stores the body under --root, written beside its place and renamed into it (as
nginx's WebDAV module does), and answers 201. --backlog is the listen queue (python's
default is 5); --keep-alive speaks HTTP/1.1 and keeps connections open. A rule (first match
wins) changes the answer for matching requests:
  {"path": "<python regex on the URL path>",   # required
   "methods": ["PUT"],            # optional, default: any
   "fail_times": 2,               # optional: the rule applies to the first N matching requests only
   "status": 500,                 # optional: answer this status, and store nothing
   "reset": true,                 # optional: close the connection unanswered, store nothing
   "cut_at": 1000,                # optional (PUT): store the first N bytes in place (as a server
                                  #   writing as it receives would keep of an upload cut short),
                                  #   close the connection unanswered
   "endless": true,               # optional (GET): no Content-Length, the file, then zeros for ever
   "delay": 0.2}                  # optional: wait this long (after reading the body) before answering
Every request is appended to --log as one JSON line {"method", "path", "status", "received",
"answered"} (times in seconds since the epoch: when the request was read, when it was answered),
and every accepted connection as {"method": "CONNECT", "open": <connections open now>} (without
--keep-alive, a connection counts as open until its answer starts).
"""
import argparse, json, os, re, socketserver, tempfile, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--root", required=True); ap.add_argument("--port", type=int, default=0)
ap.add_argument("--rules"); ap.add_argument("--log"); ap.add_argument("--backlog", type=int, default=5)
ap.add_argument("--keep-alive", action="store_true")
A = ap.parse_args()
RULES = json.load(open(A.rules)) if A.rules else []
COUNT = [0] * len(RULES); LOCK = threading.Lock(); OPEN = [0]


def log(entry):
    if A.log:
        with LOCK, open(A.log, "a") as f:
            f.write(json.dumps(entry) + "\n")


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1" if A.keep_alive else "HTTP/1.0"

    def log_message(self, *a): pass

    def setup(self):
        super().setup()
        with LOCK: OPEN[0] += 1; now_open = OPEN[0]
        log({"method": "CONNECT", "open": now_open})

    def finish(self):
        super().finish()
        self._count_out()

    def _count_out(self):
        # A connection counts as open until its answer starts: once a client has its answer it
        # may open the next one before this thread has closed this one.
        with LOCK:
            if not getattr(self, "counted_out", False):
                OPEN[0] -= 1
                self.counted_out = True

    def _rule(self, path):
        with LOCK:
            for i, r in enumerate(RULES):
                if re.fullmatch(r["path"], path) and self.command in r.get("methods", [self.command]):
                    if "fail_times" in r and COUNT[i] >= r["fail_times"]:
                        continue
                    COUNT[i] += 1
                    return r
        return {}

    def _answer(self):
        received = time.time()
        path = self.path.split("?", 1)[0]
        fs = os.path.join(A.root, path.lstrip("/"))
        body = self.rfile.read(int(self.headers.get("Content-Length", 0))) if self.command == "PUT" else b""
        rule = self._rule(path)
        time.sleep(rule.get("delay", 0))
        entry = {"method": self.command, "path": path, "received": received}
        if "cut_at" in rule:
            os.makedirs(os.path.dirname(fs), exist_ok=True)
            with open(fs, "wb") as f:
                f.write(body[:rule["cut_at"]])
        if rule.get("reset") or "cut_at" in rule:
            log({**entry, "status": 0, "answered": time.time()})
            self.close_connection = True
            return
        status = rule.get("status")
        if self.command == "PUT":
            if status is None:
                os.makedirs(os.path.dirname(fs), exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=os.path.dirname(fs), prefix=".put-")
                with os.fdopen(fd, "wb") as f:
                    f.write(body)
                os.replace(tmp, fs)
                status = 201
            out = b""
        elif os.path.isfile(fs):
            status, out = status or 200, open(fs, "rb").read()
        else:
            status, out = status or 404, b"not found\n"
        if not A.keep_alive:
            self._count_out()
        self.send_response(status)
        if not rule.get("endless"):
            self.send_header("Content-Length", str(len(out)))
        # Taken before the headers go out: once they have, the client may read the answer and
        # send its next request, which another thread may log first.
        answered = time.time()
        self.end_headers()
        log({**entry, "status": status, "answered": answered})
        if self.command != "HEAD":
            self.wfile.write(out)
            while rule.get("endless"):
                try:
                    self.wfile.write(bytes(1 << 16))
                except OSError:
                    return

    do_GET = do_HEAD = do_PUT = _answer


class Server(ThreadingHTTPServer):
    request_queue_size = A.backlog
    daemon_threads = True


srv = Server(("127.0.0.1", A.port), H)
print("PORT", srv.server_address[1], flush=True)
srv.serve_forever()
