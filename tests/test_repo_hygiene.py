"""The repository works on a machine that never had it (issue 30): no tracked symlink
leaves it and no tracked file names a path of the machine it was made on. The same
check runs first in .ci/run."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout"
)


def _check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_repo", ROOT / ".ci" / "check_repo.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_this_repository_is_clean() -> None:
    assert _check().problems(ROOT) == []


def test_the_check_finds_outside_links_and_machine_paths(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    os.symlink(tmp_path / "elsewhere", repo / ".venv-vllm")  # dangling, absolute
    os.symlink("../outside", repo / "up")
    (repo / "inside").mkdir()
    os.symlink("inside", repo / "fine")
    # Spelled in two pieces so that this file itself does not hold a machine path.
    (repo / "setup.sh").write_text("python3 -m venv /" + "work/venv-x\n")
    (repo / "ok.md").write_text("schedtop run --trace /tmp/x.trace  # a user's choice\n")
    (repo / "inside" / "keep").write_text("")
    subprocess.run([*git, "add", "-A"], check=True)
    found = _check().problems(repo)
    assert any(".venv-vllm: tracked symlink to the absolute path" in f for f in found)
    assert any(f.startswith("up: ") and "outside the repository" in f for f in found)
    assert any(f.startswith("setup.sh:1: absolute path of a machine") for f in found)
    assert len(found) == 3, found
