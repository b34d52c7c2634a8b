#!/usr/bin/env python3
"""Fail when the repository holds something that only works on the machine it was made on
(issue 30): a tracked symlink that points outside the repository (or nowhere), or an
absolute path of that machine in a tracked text file. Standard library only, so that CI
runs it before setup. Prints one line per finding and exits 1, else exits 0 silently.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

# Roots that exist only on some machine: this workplace's (/work, /root), a user's home,
# a Mac's. A path under them in a tracked file is a path of the machine it was made on.
MACHINE_ROOTS = re.compile(r"(?<![\w.~$-])/(?:work|root|home/[A-Za-z_][\w-]*|Users/[\w-]+)/[\w.-]")


def tracked(root: Path) -> list[tuple[str, str]]:
    """(mode, path) of every tracked file."""
    out = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-s", "-z"], check=True, capture_output=True
    ).stdout.decode()
    rows = []
    for entry in filter(None, out.split("\0")):
        meta, path = entry.split("\t", 1)
        rows.append((meta.split()[0], path))
    return rows


def link_problem(root: Path, path: str) -> str | None:
    target = os.readlink(root / path) if (root / path).is_symlink() else None
    if target is None:  # checked out as a plain file (core.symlinks=false): read the blob
        target = (root / path).read_text()
    if os.path.isabs(target):
        return f"{path}: tracked symlink to the absolute path {target}"
    resolved = (root / path).parent.joinpath(target).resolve()
    if not resolved.is_relative_to(root.resolve()):
        return f"{path}: tracked symlink to {target}, outside the repository"
    return None


def text_problems(root: Path, path: str) -> list[str]:
    try:
        data = (root / path).read_bytes()
    except OSError:
        return []
    if b"\0" in data[:8192]:
        return []  # binary (traces, images): their bytes are not paths
    text = data.decode("utf-8", "replace")
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        if path.endswith("check_repo.py") and "MACHINE_ROOTS" in line:
            continue
        match = MACHINE_ROOTS.search(line)
        if match:
            found.append(f"{path}:{number}: absolute path of a machine: {line.strip()[:100]}")
    return found


def problems(root: Path) -> list[str]:
    found: list[str] = []
    for mode, path in tracked(root):
        if mode == "120000":
            problem = link_problem(root, path)
            if problem:
                found.append(problem)
        elif mode.startswith("100"):
            found += text_problems(root, path)
    return found


def main() -> int:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
    found = problems(root)
    for line in found:
        print(f"check_repo: {line}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
