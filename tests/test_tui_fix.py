"""From a reason to a fix without leaving the TUI (issue 27 item 2): `x` in the incidents
view offers the knob behind the longest wait's reason, runs the trace again with it in a
worker thread, and shows the change per priority and per request beside the recording."""

from __future__ import annotations

from pathlib import Path

import pytest

from replays.fix import suggest, try_fix
from tests.tui_support import (
    app_test,
    make_app,
    queueing_trace,
    queueing_workload,
    screen_text,
    submit,
    wait_until,
)
from tui.screens.incidents import IncidentsScreen, parse_setting
from tui.screens.prompt import PromptScreen
from tui.widgets.fix import FixSection


@pytest.fixture(scope="module")
def hol_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fix")
    return queueing_trace(d)


def test_the_first_value_tried() -> None:
    assert suggest("scheduler_reserve_full_isl", {}) == "scheduler_reserve_full_isl=false"
    assert suggest("num_blocks", {"num_blocks": 41}) == "num_blocks=82"
    assert suggest("kv_cache_memory", {}) == "kv_cache_memory="
    assert parse_setting(" watermark = 0.1 ") == "watermark=0.1"
    with pytest.raises(ValueError):
        parse_setting("watermark")


def test_try_fix_compares_groups_and_requests(hol_trace: Path) -> None:
    big = queueing_workload()["requests"][3]["id"]
    o = try_fix(hol_trace, "num_blocks=82", (big,))
    assert o.how == "resim" and o.unit == "steps" and o.first_difference is not None
    assert [g.key for g in o.groups] == ["0", "1", "5"]
    (r,) = o.requests
    assert r.request_id == big
    before, after = r.queue
    assert before is not None and after is not None and after < before
    assert not list(hol_trace.parent.glob("schedtop-fix-*"))  # its trace went


def test_a_timed_trace_is_predicted_in_time(tmp_path: Path) -> None:
    from tests.test_whatif import timed_trace

    trace = timed_trace(tmp_path / "timed.trace", num_blocks=40)
    o = try_fix(trace, "num_blocks=200", ("r5",))
    assert o.how == "whatif" and o.unit == "s"
    assert [g.key for g in o.groups] == ["0"] and o.groups[0].requests == 30
    assert [r.request_id for r in o.requests] == ["r5"]


@app_test
async def test_x_runs_the_knob_in_the_background_and_shows_the_change(hol_trace: Path) -> None:
    app = make_app(hol_trace)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("i")
        await wait_until(pilot, lambda: isinstance(app.screen, IncidentsScreen))
        screen = app.screen
        assert isinstance(screen, IncidentsScreen)
        await wait_until(pilot, lambda: screen.vm is not None and screen.vm.done)
        await pilot.press("x")
        await wait_until(pilot, lambda: isinstance(app.screen, PromptScreen))
        # the longest wait's reason is no free KV blocks: its knob at twice the recorded
        # pool is offered, and enter takes it
        assert app.focused is not None
        assert app.focused.value == "num_blocks=82"  # type: ignore[attr-defined]
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.screen is screen)
        section = screen.query_one(FixSection)
        await wait_until(pilot, lambda: section.state is not None and not section.state.running)
        assert section.state is not None and section.state.outcome is not None
        text = screen_text(app)
        assert "fix num_blocks=82 · resim, steps: recorded → with it" in text
        assert "prio 5 (1): TTFT p99" in text and "queue p99" in text
        # a bad value is one line in the section, and the view goes on
        await pilot.press("x")
        await wait_until(pilot, lambda: isinstance(app.screen, PromptScreen))
        await submit(pilot, "num_blocks=-3")
        await wait_until(pilot, lambda: section.state is not None and bool(section.state.error))
        assert "fix num_blocks=-3:" in screen_text(app)


@app_test
async def test_quitting_does_not_wait_for_a_fix_still_running(
    hol_trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-simulation cannot be stopped half way: it runs in a daemon thread, and the
    worker that waits for it gives up when the app goes."""
    import threading

    import replays.fix

    release = threading.Event()
    started = threading.Event()

    def slow(*args: object, **kwargs: object) -> object:
        started.set()
        release.wait()
        raise RuntimeError("released")

    monkeypatch.setattr(replays.fix, "try_fix", slow)
    app = make_app(hol_trace)
    try:
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.press("i")
            await wait_until(pilot, lambda: isinstance(app.screen, IncidentsScreen))
            await pilot.press("x")
            await wait_until(pilot, lambda: isinstance(app.screen, PromptScreen))
            await pilot.press("enter")
            await wait_until(pilot, started.is_set)
            assert "running in the background" in screen_text(app)
            await pilot.press("q")
        assert not release.is_set()  # the app is gone while the run still blocks
    finally:
        release.set()
