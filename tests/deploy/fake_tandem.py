"""A stand-in for the `tandem` executable in the launch-script tests: `fake_tandem.py worker ...`
or `fake_tandem.py frontend ...` serves /health and /live on the port the real process would
(worker: --health-port, frontend: --port, shared with SO_REUSEPORT) on loopback, and records what
it was started with in $FAKE_TANDEM_DIR/<pid>.json. Behaviour knobs (environment):

  FAKE_READY_AFTER   seconds before /health says 200 (default 0; "never" = never ready)
  FAKE_EXIT_ROLE     the role (prefill, decode, frontend) that exits on its own ...
  FAKE_EXIT_AFTER    ... this many seconds after start, with status 3
  FAKE_IGNORE_TERM   "1": ignore SIGTERM (the launcher must escalate to SIGKILL)

Every worker also starts a child (`sleep`), to show that stopping reaches a process's children.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def main() -> int:
    args = sys.argv[1:]
    kind = args[0]
    role = flag(args, "--role") or "frontend"
    port = int(flag(args, "--health-port" if kind == "worker" else "--port") or 0)
    ready_after = os.environ.get("FAKE_READY_AFTER", "0")
    started = time.monotonic()
    out = os.environ["FAKE_TANDEM_DIR"]
    child = subprocess.Popen(["sleep", "300"]) if kind == "worker" else None
    record = {"pid": os.getpid(), "kind": kind, "role": role, "args": args,
              "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "child": child and child.pid,
              "pgid": os.getpgid(0)}
    with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
        json.dump(record, f)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ready = ready_after != "never" and time.monotonic() - started >= float(ready_after)
            code = 200 if self.path == "/live" or (self.path == "/health" and ready) else 503
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a: object) -> None:
            pass

    class Server(HTTPServer):
        def server_bind(self) -> None:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            super().server_bind()

    srv = Server(("127.0.0.1", port), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()

    def on_term(*_: object) -> None:
        with open(os.path.join(out, f"{os.getpid()}.term"), "w") as f:
            f.write("term")
        if os.environ.get("FAKE_IGNORE_TERM") != "1":
            os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    exit_after = os.environ.get("FAKE_EXIT_AFTER")
    deadline = started + float(exit_after) if exit_after and \
        os.environ.get("FAKE_EXIT_ROLE") == role else None
    while deadline is None or time.monotonic() < deadline:
        time.sleep(0.05)
    return 3


if __name__ == "__main__":
    sys.exit(main())
