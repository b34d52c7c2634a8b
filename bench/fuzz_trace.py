"""A long fuzzing session of the trace reader and reducer.

    .venv/bin/python bench/fuzz_trace.py [--scale 100]

Runs tests/test_trace_fuzz.py with SCHEDTOP_FUZZ_SCALE times its CI examples (about
2,000 x scale in all), with fresh random seeds each run instead of CI's fixed ones. Any
failure is printed by hypothesis with the input that caused it."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scale",
        type=int,
        default=100,
        help="examples per test, as a multiple of the CI run (default 100)",
    )
    args = parser.parse_args()
    env = {**os.environ, "SCHEDTOP_FUZZ_SCALE": str(args.scale)}
    start = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/test_trace_fuzz.py",
            "--hypothesis-show-statistics",
        ],
        cwd=ROOT,
        env=env,
    )
    print(
        f"fuzz_trace: scale {args.scale} (about {2100 * args.scale:,} examples) in "
        f"{time.monotonic() - start:.0f} s: {'ok' if result.returncode == 0 else 'FAILED'}"
    )
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
