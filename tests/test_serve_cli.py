"""`schedtop serve`'s command line: user mistakes get one line and exit status 2, before
any model is loaded where that is possible."""

from __future__ import annotations

import socket
from pathlib import Path

from click.testing import CliRunner

from tui.cli import main


def serve(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["serve", *args])
    return result.exit_code, result.output


def test_a_taken_port_fails_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, out = serve("--port", str(port), "--model", "/nonexistent/model.gguf")
    assert code == 2
    assert f"cannot listen on 127.0.0.1:{port}" in out and "Traceback" not in out


def test_bad_options_are_usage_errors(tmp_path: Path) -> None:
    for args, words in [
        (("--trace-dir", str(tmp_path), "--no-trace"), "exclude each other"),
        (("--trace-max-bytes", "lots"), "expected a size"),
        (("--port", "70000"), "port=70000"),
        (("--max-waiting", "-1"), "-1"),
    ]:
        code, out = serve(*args)
        assert code == 2 and words in out, (args, out)


def test_a_missing_model_is_one_line(tmp_path: Path) -> None:
    code, out = serve("--port", "0", "--model", str(tmp_path / "none.gguf"))
    assert code == 2 and out.startswith("schedtop: error:") and "Traceback" not in out
