"""The import directions docs/architecture.md promises, checked on the source: a new
import that breaks them fails here rather than drifting silently (issue 23)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

WEB = {"fastapi", "starlette", "uvicorn", "pydantic", "prometheus_client", "httpx"}
OURS = {"engine", "recorder", "replays", "tui", "schedtop_server"}


def imported_modules(path: Path) -> set[str]:
    """The modules a module imports (at any depth in the file)."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def imported(path: Path) -> set[str]:
    """The top-level packages a module imports."""
    return {name.split(".")[0] for name in imported_modules(path)}


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize(
    ("package", "allowed"),
    [
        ("engine", {"engine"}),  # no web stack, nothing of ours above it
        ("recorder", {"engine", "recorder"}),
        ("replays", {"engine", "recorder", "replays"}),
        ("schedtop_server", {"engine", "recorder", "schedtop_server"}),
    ],
)
def test_layers_import_downwards_only(package: str, allowed: set[str]) -> None:
    wrong = []
    for path in modules(package):
        names = imported(path)
        bad = (names & OURS) - allowed
        if path.parent.name == "sglang" and package == "recorder":
            # A leaf plugin that nothing of ours imports: SGLang shows no per-step state
            # to snapshot, so its tap folds its own records with replays' reducer.
            bad -= {"replays"}
        if package != "schedtop_server":
            bad |= names & WEB
        if bad:
            wrong.append(f"{path.relative_to(ROOT)}: {sorted(bad)}")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_only_the_command_line_imports_the_server() -> None:
    """The TUI is a trace reader: only its command line (the composition root, however
    it is split into modules) wires a server up; the app, its screens and widgets never."""
    users = [
        p.relative_to(ROOT)
        for package in ("tui", "replays", "recorder", "engine")
        for p in modules(package)
        if "schedtop_server" in imported(p)
    ]
    assert users, "nothing starts the server: the layering test looks at the wrong tree"
    for path in users:
        assert path.parts[0] == "tui", path
        assert path.name != "app.py" and not {"widgets", "screens"} & set(path.parts), path


def test_the_tui_imports_the_engine_only_in_its_command_line() -> None:
    """The app renders replays state; only the composition root (tui/cli/, split by command
    family) builds engines. The vocabulary reaches the app through recorder.schema."""
    wrong = [
        str(p.relative_to(ROOT))
        for p in modules("tui")
        if "engine" in imported(p) and p.parent.name != "cli"
    ]
    assert not wrong, "tui modules importing engine outside tui/cli/: " + ", ".join(wrong)


def test_the_recorder_reads_an_engine_through_its_protocol() -> None:
    """recorder.recorder records any RecordedEngine (schedtop's EngineCore, or the tap
    inside vLLM's or SGLang's scheduler), so the recorder never imports the step loop but
    where a server's engine is recorded (recorder.serving), nor the model stack."""
    wrong = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in modules("recorder")
        for name in sorted(imported_modules(path))
        if (name == "engine.core" and path.name != "serving.py")
        or name.startswith("engine.model")
        or name.startswith("engine.sim")
    ]
    assert not wrong, "recorder modules importing the engine's machinery:\n" + "\n".join(wrong)
