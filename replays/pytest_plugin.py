"""A pytest plugin that turns recorded incidents into regression tests.

    pytest --schedtop-traces incidents/                 # every *.trace must re-simulate
    pytest --schedtop-traces incidents/ --schedtop-engine vllm
    pytest --schedtop-traces incidents/ --schedtop-set max_num_seqs=64

A test asks for the `schedtop_resim` fixture and calls it. With `--schedtop-traces DIR`
such a test runs once per trace in the directory (its id is the file name, so one
incident's failure hides no other's); each call re-simulates that trace (with today's
scheduler, or the installed vLLM's with `--schedtop-engine vllm`) and fails if its
decisions differ, with the message `schedtop diff` would print. A bad `--schedtop-set`
is a usage error before anything runs. Installed as a `pytest11` entry point, so any project that
installs schedtop can use it; without the package installed, `-p replays.pytest_plugin`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ENGINES = ("schedtop", "vllm")
_OVERRIDES = pytest.StashKey[dict[str, Any]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("schedtop", "re-simulate recorded schedtop traces")
    group.addoption(
        "--schedtop-traces",
        metavar="DIR",
        default=None,
        help="a directory (or one file) of traces that must re-simulate to identical decisions",
    )
    group.addoption(
        "--schedtop-engine",
        choices=ENGINES,
        default="schedtop",
        help="whose scheduler re-simulates: schedtop's (default) or the installed vLLM's",
    )
    group.addoption(
        "--schedtop-set",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        help="re-simulate with this config change (repeatable): any decision it alters fails",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Parse --schedtop-set once, up front: a typo is a usage error, not a traceback in
    every test that asks for the fixture."""
    from engine.config import parse_setting

    overrides: dict[str, Any] = {}
    for text in config.getoption("--schedtop-set", default=None) or ():
        try:
            key, value = parse_setting(text)
        except ValueError as e:
            raise pytest.UsageError(f"--schedtop-set {text!r}: {e}") from None
        overrides[key] = value
    config.stash[_OVERRIDES] = overrides


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """One test per trace of --schedtop-traces DIR, named by the file, for every test that
    uses `schedtop_resim`. A missing or empty directory is left to the fixture's call,
    which fails saying so."""
    if "schedtop_resim" not in metafunc.fixturenames:
        return
    given = metafunc.config.getoption("--schedtop-traces")
    root = Path(given) if given else None
    if root is None or not root.is_dir():
        return
    found = sorted(root.glob("*.trace"))
    if found:
        metafunc.parametrize("_schedtop_trace", found, ids=[p.name for p in found])


@pytest.fixture
def _schedtop_trace(request: pytest.FixtureRequest) -> Path | None:
    """The trace this test instance checks (parametrized above); None when unparametrized."""
    return getattr(request, "param", None)


@dataclass
class ResimCheck:
    """What `schedtop_resim` returns: call it to check every trace (or the ones given)."""

    traces: Path | None  # --schedtop-traces, if given
    engine: str  # "schedtop" or "vllm"
    overrides: dict[str, Any] = field(default_factory=dict)  # --schedtop-set values
    checked: list[Path] = field(default_factory=list)  # traces that passed so far

    def paths(self, target: str | Path | None = None) -> list[Path]:
        """The traces a call checks: `target` (a file or a directory), else the option's."""
        root = Path(target) if target is not None else self.traces
        if root is None:
            pytest.skip("no --schedtop-traces DIR given")
        if root.is_dir():
            found = sorted(root.glob("*.trace"))
            if not found:
                pytest.fail(f"{root}: no *.trace files", pytrace=False)
            return found
        if not root.exists():
            pytest.fail(f"{root}: no such file or directory", pytrace=False)
        return [root]

    def __call__(
        self, target: str | Path | None = None, engine: str | None = None, **overrides: Any
    ) -> list[Path]:
        """Re-simulate each trace; fail at the first that does not reproduce. Keyword
        arguments are config changes on top of --schedtop-set's. Returns the traces."""
        changes = {**self.overrides, **overrides}
        chosen = engine or self.engine
        for path in self.paths(target):
            problem = check_trace(path, chosen, changes)
            if problem is not None:
                pytest.fail(problem, pytrace=False)
            self.checked.append(path)
        return self.checked


def check_trace(path: Path, engine: str, overrides: dict[str, Any]) -> str | None:
    """None when `path` re-simulates to the same decisions; else the diff, as a message."""
    from replays.diff import diff_traces, format_diff
    from replays.resim import ResimError

    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: must be one of {ENGINES}")
    with _scratch() as out:
        try:
            divergence = _resimulate(path, engine, overrides, out)
        except ResimError as e:
            return f"{path}: cannot re-simulate: {e}"
        if divergence is None:
            return None
        changed = ", ".join(f"{k}={v}" for k, v in overrides.items())
        head = (
            f"{path}: re-simulated with {engine}'s scheduler"
            + (f" and {changed}" if changed else "")
            + f": decisions differ from step {divergence}"
        )
        return head + "\n" + format_diff(diff_traces(path, out))


def _resimulate(path: Path, engine: str, overrides: dict[str, Any], out: Path) -> int | None:
    """The first divergent step, or None."""
    if engine == "vllm":
        from replays.vllm_resim import resimulate_with_vllm

        return resimulate_with_vllm(path, overrides, out).divergence_step
    from replays.resim import resimulate

    result = resimulate(path, overrides, out)
    return None if result.divergence is None else result.divergence.step


class _scratch:
    """A temporary trace path, removed afterwards."""

    def __enter__(self) -> Path:
        self._dir = tempfile.TemporaryDirectory(prefix="schedtop-resim-")
        return Path(self._dir.name) / "resim.trace"

    def __exit__(self, *exc: object) -> None:
        self._dir.cleanup()


@pytest.fixture
def schedtop_resim(
    request: pytest.FixtureRequest, _schedtop_trace: Path | None
) -> Iterator[ResimCheck]:
    """Re-simulates recorded traces; see the module's docstring."""
    cfg = request.config
    given = cfg.getoption("--schedtop-traces")
    traces = _schedtop_trace or (Path(given) if given else None)
    overrides: dict[str, Any] = cfg.stash[_OVERRIDES]
    yield ResimCheck(traces, cfg.getoption("--schedtop-engine"), dict(overrides))
