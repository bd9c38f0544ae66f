#!/usr/bin/env python3
"""A hostile far end of an ssh:// store: speaks Nix's serve protocol (2.7) and answers each
command with bytes a test prepared in DIR (argv[1]; the arguments Nix appends follow):

  closure            the reply to QueryClosure
  infos              the reply to QueryPathInfos
  valid              the reply to QueryValidPaths
  nar-<base name>    the reply to DumpStorePath of /nix/store/<base name>
  endless            DumpStorePath answers a NAR of one regular file that never ends
  stall              DumpStorePath answers nothing; the far end reads until its input ends
  greet-late         the greeting is answered only once the first command has arrived

Every command it is sent is appended to DIR/log, one name a line."""

import os
import struct
import sys

d = sys.argv[1]
r, w = sys.stdin.buffer, sys.stdout.buffer


def u64():
    b = r.read(8)
    if len(b) < 8:
        sys.exit(0)
    return struct.unpack("<Q", b)[0]


def string():
    n = u64()
    b = r.read(n + (-n % 8))
    return b[:n].decode()


def strings():
    return [string() for _ in range(u64())]


def reply(name):
    with open(os.path.join(d, name), "rb") as f:
        w.write(f.read())
    w.flush()


def log(what):
    with open(os.path.join(d, "log"), "a") as f:
        f.write(what + "\n")


def nar_string(s):
    return struct.pack("<Q", len(s)) + s + b"\0" * (-len(s) % 8)


assert u64() == 0x390C9DEB
u64()
first = u64() if os.path.exists(os.path.join(d, "greet-late")) else None
w.write(struct.pack("<QQ", 0x5452EECB, 0x207))
w.flush()
while True:
    cmd, first = (u64() if first is None else first), None
    if cmd == 1:
        u64(), u64(), strings()
        log("QueryValidPaths")
        reply("valid")
    elif cmd == 2:
        strings()
        log("QueryPathInfos")
        reply("infos")
    elif cmd == 3:
        base = string().rsplit("/", 1)[-1]
        log("DumpStorePath " + base)
        if os.path.exists(os.path.join(d, "stall")):
            r.read()
            sys.exit(0)
        if os.path.exists(os.path.join(d, "endless")):
            head = b"".join(nar_string(s) for s in [b"nix-archive-1", b"(", b"type", b"regular", b"contents"])
            w.write(head + struct.pack("<Q", 1 << 62))
            chunk = b"\0" * (1 << 16)
            while True:
                w.write(chunk)
        reply("nar-" + base)
    elif cmd == 7:
        u64(), strings()
        log("QueryClosure")
        reply("closure")
    else:
        sys.exit("unexpected command %d" % cmd)
