"""SGLang's real scheduler recorded by recorder.sglang (issue 29).

SGLang runs in its own venv ($SCHEDTOP_SGLANG_PYTHON, else .venv-sglang/bin/python), in a
subprocess (tests/sglang_engine.py): its real engine on the CPU with random weights and a
tiny Llama, the plugin loaded by SGLANG_PLUGINS=schedtop, through workloads of several
shapes: prefix sharing, chunked long prompts, aborts (waiting and running) in one engine;
decoding under a small pool with SGLANG_TEST_RETRACT=1 (retractions), then prompts
that need more than is free (radix-cache evictions), in a second (the variable is read
at start-up); in a third, decoding that outgrows a small pool, where
SGLang retracts on its own, after which its scheduler process is killed. Each engine
start-up costs about 17 s, so the shapes share engines. The recorder checks each record
against the state it builds (SCHEDTOP_STRICT); here every trace must account for every
request sent, and the readers must work on it. Each trace is then re-simulated by
SGLang's own scheduler (`resim --engine sglang`: one SGLang start-up per trace, no
engine), which must reproduce every decision, and by schedtop's (`resim`), a cross-engine
what-if. Without an SGLang venv these tests skip, except in CI (CI=true),
where that is a failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from recorder.reader import TraceReader
from recorder.schema import Kind, Reason, Status, Step
from replays.reducer import apply
from replays.state import State
from replays.timeline import Timeline
from tests.helpers import ROOT, engine_python

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

# SGLang's finish types as the client sees them, and the trace's statuses for them
FINISH = {
    "length": Status.FINISHED_LENGTH_CAPPED,
    "abort": Status.FINISHED_ABORTED,
    "stop": Status.FINISHED_STOPPED,
}
ENGINES: list[dict[str, Any]] = [
    {
        "name": "shapes",
        "args": {"max_total_tokens": 4096, "chunked_prefill_size": 64, "max_running_requests": 6},
        "shapes": ["prefix_sharing", "chunked", "aborts"],
    },
    {
        "name": "retract",
        "env": {"SGLANG_TEST_RETRACT": "1"},
        "args": {"max_total_tokens": 1024, "max_running_requests": 8},
        # then prompts that need more than the pool has free: evictions (format 1.8)
        "shapes": ["decode_heavy", "evictions"],
    },
    {
        # retraction as SGLang decides it, not forced; the flush timer at 0.2 s, so that
        # the steps reach the file while the batch decodes; then the scheduler is killed
        "name": "natural",
        "env": {"SCHEDTOP_FLUSH_INTERVAL_S": "0.2"},
        "args": {"max_total_tokens": 1024, "max_running_requests": 16},
        "shapes": ["natural_retract"],
        "kill": True,
    },
]


@pytest.fixture(scope="session")
def sglang_python() -> str:
    return engine_python("SGLang", ".ci/sglang-venv")


@pytest.fixture(scope="session")
def recorded(sglang_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both engines' traces and what was sent to them: {name: {trace, sent, error}}."""
    root = tmp_path_factory.mktemp("sglang")
    (root / "spec.json").write_text(json.dumps({"root": str(root), "engines": ENGINES}))
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    env["SGLANG_PLUGINS"] = "schedtop"
    env["SCHEDTOP_STRICT"] = "1"  # a record that does not fit its state fails the run
    env["SCHEDTOP_SNAPSHOT_INTERVAL"] = "16"  # snapshots in every trace
    proc = subprocess.run(
        [
            sglang_python,
            "-m",
            "tests.sglang_engine",
            str(root / "spec.json"),
            str(root / "out.json"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out: dict[str, Any] = json.loads((root / "out.json").read_text())
    for name, result in out.items():
        assert result["error"] is None, f"{name}: {result['error']}"
    return out


def steps_of(trace: Path, recorded: bool = True) -> tuple[Any, list[Step]]:
    """The header and the steps, each applied to the state (which checks it), with every
    snapshot compared with the state the steps before it built. `recorded`: one of the
    engines' traces (SCHEDTOP_SNAPSHOT_INTERVAL=16), not a re-simulation's."""
    with TraceReader(trace) as reader:
        header = reader.header
        state = State.initial(header)
        steps = []
        snapshots = 0
        for entry in reader.entries():
            rec = entry.record
            if isinstance(rec, Step):
                apply(state, rec)
                steps.append(rec)
            elif rec is not None and type(rec).__name__ == "Snapshot":
                snapshots += 1
                assert State.from_snapshot(header, rec).to_snapshot() == state.to_snapshot()
    assert not state.requests, f"{trace.name}: requests left unfinished: {state.requests}"
    if recorded:
        assert snapshots >= len(steps) // 16 - 1, "SCHEDTOP_SNAPSHOT_INTERVAL=16 places them"
    return header, steps


def test_sglang_traces_account_for_every_request(recorded: dict[str, Any]) -> None:
    for result in recorded.values():
        header, steps = steps_of(Path(result["trace"]))
        assert header.engine == "SGLang 0.5.23 (Scheduler)"
        assert header.kv_pool == "tokens" and header.block_size == 1
        arrivals = {a.request_id: a for s in steps for a in s.arrivals}
        finishes = {f.ref: f for s in steps for f in s.finishes}
        assert len(finishes) == len(arrivals)
        for sent in result["sent"]:
            a = arrivals[sent["rid"]]
            assert a.num_prompt_tokens == sent["prompt"], sent
            assert finishes[a.ref].status == FINISH[sent["finish"]], sent
        # the pool's free slots, which a retraction's pool can run out of (natural)
        assert all(s.free_slots <= header.num_blocks - 1 for s in steps)
        assert any(s.free_slots > 0 for s in steps)
        assert all(s.work_ns > 0 for s in steps), "each step's work is timed"
    _, shapes = steps_of(Path(recorded["shapes"]["trace"]))
    hits = [a.cached_tokens for s in shapes for a in s.admissions if a.cached_tokens > 0]
    assert len(hits) >= 5, "the shared prefix was matched in the radix cache"
    assert any(e.kind == Kind.CHUNK for s in shapes for e in s.scheduled), "chunked prompts"
    aborts = [f for s in shapes for f in s.finishes if f.status == Status.FINISHED_ABORTED]
    assert len(aborts) == 4
    for name in ("retract", "natural"):  # SGLANG_TEST_RETRACT=1, and SGLang's own decision
        header, retract = steps_of(Path(recorded[name]["trace"]))
        retractions = [p for s in retract for p in s.preemptions]
        assert retractions and all(p.cause == Reason.RETRACTED for p in retractions), name
        assert any(a.resumed for s in retract for a in s.admissions), "retracted ones came back"
    assert header.config["sglang_test_retract_interval"] == 0, "nothing forced it"
    # prompts that need more than is free evict what the radix cache holds (format 1.8)
    pool, retract = steps_of(Path(recorded["retract"]["trace"]))
    evicted = [s.evicted_slots for s in retract if s.evicted_slots]
    assert evicted, "the radix cache gave slots back to a full pool"
    assert all(0 < n <= pool.num_blocks - 1 for n in evicted)


def test_sglang_traces_map_every_slot(recorded: dict[str, Any]) -> None:
    """Format 1.9: each step's slot runs rebuild SGLang's token pool slot by slot. The
    reducer checks every step's free slots against the allocator's count (free_slots less
    the evictable ones); here, in addition, the slots the running requests' rows hold are
    exactly the pool less what a new request could get (free or evictable), and the TUI's
    map shows that many held."""
    from tui.viewmodel import SHARED, USED, _blocks

    for name, result in recorded.items():
        with TraceReader(Path(result["trace"])) as reader:
            header = reader.header
            assert header.slot_map, name
            state = State.initial(header)
            steps = []
            for entry in reader.entries():
                rec = entry.record
                if not isinstance(rec, Step):
                    continue
                apply(state, rec)
                steps.append(rec)
                assert state.slots is not None
                held = {s for row in state.slots.rows.values() for s in row if s}
                assert len(held) == header.num_blocks - 1 - rec.free_slots, (name, rec.step)
                assert state.slots.evictable == rec.evictable_slots <= rec.cached_slots
                if rec.step % 16 == 0:
                    vm = _blocks(state)
                    assert vm.pool == "tokens"
                    assert vm.cls.count(USED) + vm.cls.count(SHARED) == len(held)
        allocated = sum(n for s in steps for n in s.slot_allocs[1::2])
        assert allocated == sum(s.num_scheduled_tokens for s in steps), name
        assert any(w.position == 0 for s in steps for w in s.slot_writes) or name != "shapes"
    _, retract = steps_of(Path(recorded["retract"]["trace"]))
    for s in retract:  # what the radix cache evicted went back through the allocator
        assert sum(s.slots_freed_first[1::2]) + sum(s.slots_freed[1::2]) >= s.evicted_slots
    assert any(s.preemptions and s.slots_freed_first for s in retract), "retractions free"


def test_a_killed_sglang_scheduler_leaves_a_readable_trace(recorded: dict[str, Any]) -> None:
    """SGLang SIGKILLs its scheduler at shutdown: no footer. The flush timer put the steps
    in the file while the batch still decoded (the scheduler never went idle, when the
    recorder flushes too); after a real SIGKILL the trace reads to its last whole record,
    `info` calls it a cut tail, not an error, and every request is in it."""
    natural = recorded["natural"]
    assert natural["killed"], "the scheduler process was killed"
    assert natural["seen_mid_run"] > 0, "no step reached the file before the batch ended"
    trace = natural["trace"]
    with TraceReader(Path(trace)) as reader:
        assert reader.footer is None
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    info = subprocess.run(
        [sys.executable, "-m", "tui.cli", "info", trace], env=env, capture_output=True, text=True
    )
    assert info.returncode == 0, info.stderr
    assert "no footer" in info.stdout and "Traceback" not in info.stderr
    n = len(natural["sent"])
    assert f"{n} arrived, {n} finished" in info.stdout


def test_info_stats_find_export_replay_work_on_sglang_traces(recorded: dict[str, Any]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "tui.cli"]
    for result in recorded.values():
        trace = result["trace"]
        n = len(result["sent"])
        info = subprocess.run([*cli, "info", trace], env=env, capture_output=True, text=True)
        assert info.returncode == 0, info.stderr
        assert f"{n} arrived, {n} finished" in info.stdout
        stats = subprocess.run(
            [*cli, "stats", trace, "--json"], env=env, capture_output=True, text=True
        )
        assert stats.returncode == 0, stats.stderr
        numbers = json.loads(stats.stdout)
        assert numbers["num_requests"] == numbers["num_finished"] == n
        assert numbers["kv_pool"] == "tokens" and numbers["peak_blocks"] > 0
    retract = recorded["retract"]["trace"]
    found = subprocess.run(
        [*cli, "find", retract, "preempt", "--all"], env=env, capture_output=True, text=True
    )
    assert found.returncode == 0 and found.stdout.strip(), found.stderr
    perfetto = Path(retract).with_suffix(".perfetto.json")
    exported = subprocess.run(
        [*cli, "export", retract, "--perfetto", str(perfetto)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert exported.returncode == 0, exported.stderr
    assert json.loads(perfetto.read_text())["traceEvents"]
    with TraceReader(Path(retract)) as reader:
        timeline = Timeline(reader)
        last = timeline.last_step
        assert timeline.state(last).step == last
        assert timeline.state(last // 2).step == last // 2
    asyncio.run(_replay_headless(Path(recorded["shapes"]["trace"])))


async def _replay_headless(trace: Path) -> None:
    """The TUI opens an SGLang trace and steps to its end."""
    from tests.tui_support import at_step, make_app

    with TraceReader(trace) as reader:
        last = Timeline(reader).last_step
    app = make_app(trace)
    async with app.run_test(size=(160, 50)) as pilot:
        await at_step(pilot, 0)
        await pilot.press("end")
        await at_step(pilot, last)


def test_resim_engine_sglang_reproduces_every_decision(
    recorded: dict[str, Any], sglang_python: str, tmp_path: Path
) -> None:
    """SGLang's scheduler, driven offline with each trace's inputs, decides as it did
    in the engine: prefix hits, chunks, aborts (waiting and running), retractions."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SCHEDTOP_SGLANG_PYTHON": sglang_python}
    for name, result in recorded.items():
        out = tmp_path / f"{name}.resim.trace"
        resim = subprocess.run(
            [sys.executable, "-m", "tui.cli", "resim", result["trace"], "--engine", "sglang"]
            + ["--trace", str(out)],
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert resim.returncode == 0, f"{name}: {resim.stdout[-3000:]}{resim.stderr[-3000:]}"
        assert "every decision reproduced" in resim.stdout, resim.stdout
        _, original = steps_of(Path(result["trace"]))
        _, again = steps_of(out, recorded=False)
        assert len(again) == len(original)


def test_resim_engine_schedtop_on_sglang_traces_is_a_cross_engine_whatif(
    recorded: dict[str, Any], tmp_path: Path
) -> None:
    """schedtop's scheduler on an SGLang trace: labelled a what-if, the decisions
    compared with `diff`'s machinery, exit 0 however much they differ."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "cross.trace"
    resim = subprocess.run(
        [sys.executable, "-m", "tui.cli", "resim", recorded["retract"]["trace"]]
        + ["--trace", str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert resim.returncode == 0, resim.stderr
    assert resim.stdout.startswith("cross-engine what-if"), resim.stdout
    # SGLang's retractions against vLLM's policy on the same pool: none needed
    assert "first difference at step" in resim.stdout
    assert "preemptions" in resim.stdout
    header, steps = steps_of(out, recorded=False)
    assert header.kv_pool == "blocks" and header.block_size == 1
    assert not any(s.preemptions for s in steps)
