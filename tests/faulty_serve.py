"""`python -m tests.faulty_serve serve ...`: the schedtop command line with an engine whose
step fails after $SCHEDTOP_TEST_FAIL_AFTER_STEPS steps, for the test that a dead engine
ends the server process with an error (tests/test_serve_process.py)."""

from __future__ import annotations

import os
from typing import Any

from engine.model.llm_engine import LLMEngine
from tui.cli import main

_step = LLMEngine.step
_after = int(os.environ.get("SCHEDTOP_TEST_FAIL_AFTER_STEPS", "0"))
_count = 0


def _failing_step(self: LLMEngine) -> Any:
    global _count
    _count += 1
    if _count > _after:
        raise RuntimeError("injected engine fault")
    return _step(self)


LLMEngine.step = _failing_step  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
