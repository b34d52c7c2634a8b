"""A 20 MB request body against `schedtop serve` while another client streams (issue 26's
done-when: the 413 within 100 ms, the stream's token gaps under 2x their unloaded p99).

On the default model, default settings (--max-body-size 8 MiB):
1. Unloaded: one streamed completion (T tokens, greedy, EOS ignored) alone; the gaps
   between its token chunks as the client reads them.
2. Loaded: the same stream again, and meanwhile K (20) bodies of 20 MB sent one after the
   other over raw sockets, each the whole body as fast as loopback takes it: half with
   a Content-Length (refused on the headers), half chunked (no length: refused once the
   bytes read pass the limit). For each, the time from its first byte sent to the 413's
   status line; for the stream, its gaps while the bodies were being refused.

    .venv/bin/python bench/body_limit_bench.py [--tokens 200] [--bodies 20] [--size-mb 20]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from serve_bench import Server  # noqa: E402

from engine.records import percentile  # noqa: E402

BODY = {"prompt": "the sea is", "temperature": 0, "ignore_eos": True, "stream": True}


def stream(url: str, tokens: int, times: list[float], started: threading.Event) -> None:
    """One streamed completion; the arrival time of every token chunk into `times`."""
    with httpx.stream(
        "POST", url + "/v1/completions", json={**BODY, "max_tokens": tokens}, timeout=600
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if len(times) == 10:
                    started.set()
    started.set()


def big_post(url: str, size: int, chunked: bool) -> float:
    """Seconds from the first byte of a `size`-byte body to the reply's status line (a
    sender thread pushes the whole body meanwhile, as a real client would)."""
    u = urlparse(url)
    sock = socket.create_connection((u.hostname, u.port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
    )
    head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {size}\r\n\r\n"
    piece = b"a" * (1 << 20)

    def send() -> None:
        try:
            sent = 0
            while sent < size:
                n = min(len(piece), size - sent)
                data = piece[:n]
                sock.sendall(b"%x\r\n%s\r\n" % (n, data) if chunked else data)
                sent += n
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered and closed: the rest is not wanted

    t0 = time.perf_counter()
    sock.sendall(head.encode())
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    reply = b""
    while b"\r\n" not in reply:
        got = sock.recv(4096)
        if not got:
            break
        reply += got
    elapsed = time.perf_counter() - t0
    status = reply.split(b"\r\n", 1)[0].decode(errors="replace")
    if " 413 " not in status + " ":
        raise SystemExit(f"expected a 413, got {status!r}")
    sock.close()
    sender.join(10)
    return elapsed


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--bodies", type=int, default=20)
    ap.add_argument("--size-mb", type=float, default=20)
    args = ap.parse_args()
    size = int(args.size_mb * 1e6)
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(Path(tmp))
        try:
            quiet: list[float] = []
            stream(server.url, args.tokens, quiet, threading.Event())
            loaded: list[float] = []
            started = threading.Event()
            t = threading.Thread(target=stream, args=(server.url, args.tokens, loaded, started))
            t.start()
            started.wait(600)
            window_start = time.perf_counter()
            refusals = [
                (i % 2 == 1, big_post(server.url, size, i % 2 == 1)) for i in range(args.bodies)
            ]
            window_end = time.perf_counter()
            t.join(600)
            health = httpx.get(server.url + "/health").json()
        finally:
            server.stop()
    # gaps that ended inside the window of the big bodies (plus one gap after it)
    during = [b - a for a, b in zip(loaded, loaded[1:]) if window_start <= b and a <= window_end]
    q_p99 = percentile(gaps(quiet[1:]), 99) or 0.0
    print(f"{args.bodies} bodies of {args.size_mb:g} MB during a {args.tokens}-token stream; "
          f"server health after: {json.dumps(health)}")  # fmt: skip
    for chunked in (False, True):
        xs = [s for c, s in refusals if c == chunked]
        kind = "chunked (no length)" if chunked else "Content-Length"
        print(
            f"413, {kind:<20} p50 {percentile(xs, 50) * 1e3:6.1f} ms   max {max(xs) * 1e3:6.1f} ms"
        )
    print(f"{'':<28} {'unloaded':>10} {'during':>10} {'during/unloaded p99':>20}")
    d_p99, d_max = percentile(during, 99) or 0.0, max(during, default=0.0)
    print(f"{'stream gap p50':<28} {percentile(gaps(quiet[1:]), 50) * 1e3:>8.1f}ms "
          f"{(percentile(during, 50) or 0) * 1e3:>8.1f}ms")  # fmt: skip
    ratio = d_p99 / q_p99
    print(f"{'stream gap p99':<28} {q_p99 * 1e3:>8.1f}ms {d_p99 * 1e3:>8.1f}ms {ratio:>19.2f}x")
    print(f"{'stream gap max':<28} {max(gaps(quiet[1:])) * 1e3:>8.1f}ms {d_max * 1e3:>8.1f}ms "
          f"{d_max / q_p99:>19.2f}x")  # fmt: skip
    print(
        f"gaps during the bodies: {len(during)} (window {1e3 * (window_end - window_start):.0f} ms)"
    )


if __name__ == "__main__":
    main()
