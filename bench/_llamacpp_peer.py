"""The llama.cpp side of engine_bench.py: runs under an interpreter that has
llama-cpp-python (its own venv; see engine_bench.py's docstring for how it is built).

Reads a JSON job on stdin: the GGUF path, the thread count, the requests (prompt token
ids, arrival time, tokens to generate) and the mode, and prints one JSON result: output
tokens, total seconds, and per-request TTFT and TPOT.

Modes:
- "python": llama.cpp through its Python API, one sequence at a time in arrival order
  (each request starts when it has arrived and the previous one is done), greedy, EOS
  ignored: what a single-user llama.cpp program does.
- "server": llama.cpp's own HTTP server (`llama-server`, its binary given in the job) with
  as many parallel slots as the job asks (continuous batching across slots), on
  127.0.0.1 at a free port; each request is sent at its arrival time and streamed, so TTFT
  and TPOT are what a client sees. The server is stopped before the result is printed."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from typing import Any


def run_python(job: dict[str, Any]) -> dict[str, Any]:
    from llama_cpp import Llama

    longest = max(len(r["prompt"]) + r["max_tokens"] for r in job["requests"])
    llm = Llama(
        model_path=job["model"],
        n_ctx=longest + 16,
        n_batch=512,
        n_threads=job["threads"],
        n_threads_batch=job["threads"],
        verbose=False,
    )
    ttft, tpot = [], []
    out_tokens = 0
    t0 = time.perf_counter()
    last = t0
    for r in job["requests"]:
        arrival = t0 + r["arrival"]
        time.sleep(max(0.0, arrival - time.perf_counter()))
        llm.reset()  # no reuse of the previous prompt's cache: each request stands alone
        times = []
        for _ in llm.generate(r["prompt"], top_k=1, temp=0.0, reset=True):
            times.append(time.perf_counter())
            if len(times) == r["max_tokens"]:
                break
        out_tokens += len(times)
        ttft.append(times[0] - arrival)
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
        last = times[-1]
    return {
        "output_tokens": out_tokens,
        "total_s": last - (t0 + job["requests"][0]["arrival"]),
        "ttft": ttft,
        "tpot": tpot,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"llama-server not ready after {timeout_s:.0f} s")


def stream_one(port: int, r: dict[str, Any], t0: float, result: dict[str, Any]) -> None:
    arrival = t0 + r["arrival"]
    time.sleep(max(0.0, arrival - time.perf_counter()))
    body = json.dumps(
        {
            "prompt": r["prompt"],
            "n_predict": r["max_tokens"],
            "ignore_eos": True,
            "temperature": 0.0,
            "top_k": 1,
            "cache_prompt": False,
            "stream": True,
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    times = []
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        event = json.loads(line[6:])
        if event.get("content") or event.get("tokens"):
            times.append(time.perf_counter())
        if event.get("stop"):
            break
    conn.close()
    result["n"] = len(times)
    result["ttft"] = times[0] - arrival if times else None
    result["tpot"] = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    result["end"] = times[-1] if times else time.perf_counter()


def run_server(job: dict[str, Any]) -> dict[str, Any]:
    slots = job["slots"]
    longest = max(len(r["prompt"]) + r["max_tokens"] for r in job["requests"])
    port = free_port()
    cmd = [
        job["server"],
        *("-m", job["model"], "--host", "127.0.0.1", "--port", str(port)),
        *("-np", str(slots), "-c", str(slots * (longest + 16))),
        *("-t", str(job["threads"]), "-tb", str(job["threads"]), "-b", "512"),
        "--no-webui",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(port, proc, 120)
        results: list[dict[str, Any]] = [{} for _ in job["requests"]]
        t0 = time.perf_counter()
        threads = [
            threading.Thread(target=stream_one, args=(port, r, t0, res), daemon=True)
            for r, res in zip(job["requests"], results)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=1800)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {
        "output_tokens": sum(r.get("n", 0) for r in results),
        "total_s": max(r["end"] for r in results) - (t0 + job["requests"][0]["arrival"]),
        "ttft": [r["ttft"] for r in results if r.get("ttft") is not None],
        "tpot": [r["tpot"] for r in results if r.get("tpot") is not None],
    }


def main() -> int:
    job = json.load(sys.stdin)
    result = run_server(job) if job["mode"] == "server" else run_python(job)
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
