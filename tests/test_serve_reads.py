"""Large bodies are read in large pieces (schedtop_server.server's protocol): a chunked
body has no length to refuse on, so the server counts it as it comes; each 256 KiB read
was an event-loop turn, and under a streaming load a 20 MB chunked body took 74 ms to be
refused (issue 26 done-when 2). The read size goes back once the response is out."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from schedtop_server.server import LARGE_READ_BYTES, _protocol_class
from tests.model_support import write_tiny_gguf
from tests.serve_support import ServerProcess


class _Transport:
    max_size = 256 * 1024  # asyncio's default recv() size


def test_a_full_read_widens_the_next_ones_until_the_response_is_out() -> None:
    cls: Any = _protocol_class(30.0)
    proto = cls.__new__(cls)  # only the read-size logic: no connection behind it
    proto.transport = _Transport()
    proto._widen(1000)  # a small request: nothing changes
    assert proto.transport.max_size == 256 * 1024
    proto._widen(256 * 1024)  # the buffer came back full: more is waiting
    assert proto.transport.max_size == LARGE_READ_BYTES
    proto._widen(LARGE_READ_BYTES)
    assert proto.transport.max_size == LARGE_READ_BYTES
    proto._narrow()
    assert proto.transport.max_size == 256 * 1024 and proto._read_size is None
    proto._narrow()  # twice is harmless
    assert proto.transport.max_size == 256 * 1024


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("model"))


def test_a_chunked_body_over_the_limit_is_refused_and_the_server_goes_on(model: Path) -> None:
    args = ["--model", str(model), "--num-gpu-blocks-override", "128", "--no-trace"]
    with ServerProcess([*args, "--max-body-size", "2MiB"]) as server:
        host, port = server.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            piece = b"a" * (1 << 20)

            def send() -> None:
                try:
                    for _ in range(8):  # 8 MiB, four times the limit
                        s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                except OSError:
                    pass  # refused and closed: the rest is not wanted

            sender = threading.Thread(target=send, daemon=True)
            sender.start()
            s.settimeout(60)
            reply = b""
            while b"\r\n" not in reply:
                got = s.recv(4096)
                if not got:
                    break
                reply += got
            assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        sender.join(60)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
