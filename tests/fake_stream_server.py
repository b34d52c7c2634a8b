"""A stand-in for `schedtop serve`'s live stream, as a process a test can kill: it records
the built-in sim workload once, then serves its stream to each viewer in two parts with an
idle gap between them, and keeps the connection open until it is killed.

    python -m tests.fake_stream_server IDLE_S FIRST_STEPS

prints `port N` once it listens; /v1/schedtop/stream is the only path."""

from __future__ import annotations

import http.server
import sys
import tempfile
import time
from pathlib import Path

from engine.sim.driver import make_engine, run_steps
from recorder.serving import ServerRecording
from tests.tui_support import demo_workload


def record(directory: Path) -> list[bytes]:
    """The stream a viewer attached before the first step gets: one chunk per step (the
    first with the preamble, header and snapshot)."""
    w = demo_workload()
    engine = make_engine(w)
    rec = ServerRecording(engine, directory / "run")
    sub = rec.subscribe()
    chunks: list[bytes] = []
    for _ in run_steps(w, engine):
        out = bytearray()
        while chunk := sub.get(0):
            out += chunk
        chunks.append(bytes(out))
    rec.close()
    return [c for c in chunks if c]


def main() -> None:
    idle_s, first = float(sys.argv[1]), int(sys.argv[2])
    with tempfile.TemporaryDirectory() as tmp:
        chunks = record(Path(tmp))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 -- http.server's name
            if self.path != "/v1/schedtop/stream":
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            for i, chunk in enumerate(chunks):
                if i == first:
                    time.sleep(idle_s)  # the server goes quiet, then serves again
                self.wfile.write(chunk)
                self.wfile.flush()
                time.sleep(0.01)
            while True:  # idle for good: only a kill ends the stream
                time.sleep(1)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"port {server.server_address[1]} steps {len(chunks)}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
