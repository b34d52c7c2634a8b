"""Sweeps: every trace under every config of a grid, through `replays.whatif`, ranked.

A task is one (trace, grid point); it is a pure function of its inputs (the predicted run
has an integer clock and no randomness), so the table is the same whichever executor ran
it: in this process, a local process pool, or Ray (`schedtop[ray]`; a local cluster, or the
one at RAY_ADDRESS). A task that fails comes back as a row naming its trace, config and
error; the others finish.
"""

from __future__ import annotations

import csv
import io
import itertools
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from engine.config import parse_setting
from recorder.reader import TraceReader
from replays.costmodel import TRUST_R2, CostModel
from replays.whatif import METRICS, WhatifError, format_metric, whatif

EXECUTORS = ("serial", "pool", "ray")
_SHOWN = ("ttft_p99", "tpot_p50", "throughput", "preemptions")  # beside the objective
MAXIMISED = frozenset({"throughput"})  # every other objective is a cost
Progress = Callable[[int, int], None]  # (tasks done, tasks in all)


class SweepError(WhatifError):
    """A grid, an objective or a trace list that a sweep cannot run."""


@dataclass(frozen=True)
class SweepTask:
    """One trace under one grid point."""

    trace: str  # the trace's path
    overrides: tuple[tuple[str, Any], ...]  # the grid point (key, value), in grid order
    model: CostModel | None  # the step-time model; None: fitted on the trace itself
    recorded: bool  # the grid point is the trace's recorded config
    min_r2: float | None = None  # refuse a fitted model whose held-out R² is below it


@dataclass
class SweepRow:
    """What one task predicted (or why it failed)."""

    trace: str  # the trace's path
    config: dict[str, Any]  # the grid point
    recorded: bool  # the grid point is the trace's recorded config
    metrics: dict[str, Any] | None = None  # the predicted TimedMetrics; None on error
    error: str | None = None  # why the task failed
    fit_r2: float | None = None  # the step-time model's held-out R² (None: given by hand)

    @property
    def untrusted(self) -> bool:
        """Predicted with a model that explains too little of its steps (TRUST_R2)."""
        return self.fit_r2 is not None and self.fit_r2 < TRUST_R2

    def value(self, objective: str) -> float | None:
        v = None if self.metrics is None else self.metrics.get(objective)
        return None if v is None else float(v)


def parse_grid(grid: Sequence[str]) -> list[tuple[str, list[Any]]]:
    """`KEY=V1,V2,...` options into typed (key, values), in the order given."""
    out: list[tuple[str, list[Any]]] = []
    for text in grid:
        key, sep, raw = text.partition("=")
        if not sep or not raw.strip():
            raise SweepError(f"--grid {text!r}: expected KEY=V1,V2,...")
        try:
            values = [parse_setting(f"{key}={v}")[1] for v in raw.split(",")]
            name = parse_setting(f"{key}={raw.split(',')[0]}")[0]
        except ValueError as e:
            raise SweepError(f"--grid: {e}") from None
        if any(k == name for k, _ in out):
            raise SweepError(f"--grid: {name} is given twice")
        out.append((name, list(dict.fromkeys(values))))
    return out


def check_objective(objective: str) -> str:
    if objective not in METRICS:
        raise SweepError(f"--objective {objective!r}: one of {', '.join(METRICS)}")
    return objective


def find_traces(paths: Iterable[str]) -> list[str]:
    """Trace files: each path itself, or the *.trace files under a directory."""
    found: list[str] = []
    for p in paths:
        path = Path(p)
        if path.is_dir():
            found += sorted(str(t) for t in path.rglob("*.trace"))
        elif path.is_file():
            found.append(str(path))
        else:
            raise SweepError(f"{p}: no such trace or directory")
    if not found:
        raise SweepError("no traces to sweep (a directory holds none ending in .trace)")
    return found


def plan(
    traces: Sequence[str],
    grid: Sequence[tuple[str, list[Any]]],
    model: CostModel | None,
    min_r2: float | None = None,
) -> list[SweepTask]:
    """The tasks: each trace under each grid point, and under its recorded config as a
    baseline when no grid point is it. `min_r2`: each task refuses a worse-fitted model."""
    keys = [k for k, _ in grid]
    points = [tuple(zip(keys, combo)) for combo in itertools.product(*(v for _, v in grid))]
    tasks: list[SweepTask] = []
    for trace in traces:
        recorded = _recorded_config(trace)
        marks = [all(recorded.get(k) == v for k, v in p) for p in points]
        if not any(marks):
            tasks.append(SweepTask(trace, (), model, True, min_r2))
        tasks += [SweepTask(trace, p, model, m, min_r2) for p, m in zip(points, marks)]
    return tasks


def _recorded_config(trace: str) -> dict[str, Any]:
    try:
        with TraceReader(trace) as reader:
            return dict(reader.header.config)
    except Exception:  # a trace that cannot be opened fails as its own tasks, named
        return {}


def run_task(task: SweepTask) -> SweepRow:
    """One task, in whatever process runs it; errors come back in the row."""
    config = dict(task.overrides)
    try:
        result = whatif(task.trace, config, task.model, check=False, min_r2=task.min_r2)
    except Exception as e:
        return SweepRow(task.trace, config, task.recorded, error=f"{type(e).__name__}: {e}")
    fit = result.model.fit
    r2 = None if fit is None else fit.trust_r2
    return SweepRow(task.trace, config, task.recorded, result.predicted.to_json(), fit_r2=r2)


def run_sweep(
    tasks: Sequence[SweepTask],
    executor: str = "pool",
    jobs: int | None = None,
    progress: Progress | None = None,
) -> list[SweepRow]:
    """Run every task; rows in task order."""
    if executor not in EXECUTORS:
        raise SweepError(f"executor {executor!r}: one of {', '.join(EXECUTORS)}")
    jobs = max(1, jobs or os.cpu_count() or 1)
    if executor == "serial" or (executor == "pool" and (jobs == 1 or len(_groups(tasks)) <= 1)):
        rows = []
        for i, t in enumerate(tasks):
            rows.append(run_task(t))
            if progress:
                progress(i + 1, len(tasks))
        return rows
    if executor == "pool":
        return _run_pool(tasks, jobs, progress)
    return _run_ray(tasks, jobs, progress)


def _groups(tasks: Sequence[SweepTask]) -> list[list[int]]:
    """Task indices in runs of the same trace: one worker takes a whole run, so it reads
    the trace once for all its configs."""
    out: list[list[int]] = []
    for i, t in enumerate(tasks):
        if out and tasks[out[-1][0]].trace == t.trace:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def run_group(tasks: list[SweepTask]) -> list[SweepRow]:
    """Several tasks in one worker, in order."""
    return [run_task(t) for t in tasks]


def _failed(t: SweepTask, e: BaseException) -> SweepRow:
    """The row of a task whose worker died before it could answer."""
    return SweepRow(t.trace, dict(t.overrides), t.recorded, error=f"worker failed: {e!r}")


def _run_pool(tasks: Sequence[SweepTask], jobs: int, progress: Progress | None) -> list[SweepRow]:
    from concurrent.futures import ProcessPoolExecutor, as_completed

    rows: list[SweepRow | None] = [None] * len(tasks)
    groups = _groups(tasks)
    done = 0
    with ProcessPoolExecutor(max_workers=min(jobs, len(groups))) as pool:
        futures = {pool.submit(run_group, [tasks[i] for i in g]): g for g in groups}
        for fut in as_completed(futures):
            g = futures[fut]
            _place(rows, tasks, g, fut.result)
            done += len(g)
            if progress:
                progress(done, len(tasks))
    return [r for r in rows if r is not None]


def _place(
    rows: list[SweepRow | None],
    tasks: Sequence[SweepTask],
    group: Sequence[int],
    result: Callable[[], list[SweepRow]],
) -> None:
    """A group's rows into their places; a group that raised fails each of its tasks."""
    try:
        for i, row in zip(group, result()):
            rows[i] = row
    except Exception as e:
        for i in group:
            rows[i] = _failed(tasks[i], e)


def _run_ray(tasks: Sequence[SweepTask], jobs: int, progress: Progress | None) -> list[SweepRow]:
    try:
        import ray
    except ImportError:
        raise SweepError("--ray needs Ray: pip install 'schedtop[ray]'") from None
    address = os.environ.get("RAY_ADDRESS") or None
    started = not ray.is_initialized()
    if started:
        # Workers import this project: give them the driver's import path.
        path = os.pathsep.join(p for p in sys.path if p)
        ray.init(
            address=address,
            num_cpus=None if address else jobs,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )
    try:
        remote = ray.remote(num_cpus=1, max_retries=0)(run_group)
        groups = _groups(tasks)
        refs = {remote.remote([tasks[i] for i in g]): g for g in groups}
        rows: list[SweepRow | None] = [None] * len(tasks)
        pending = list(refs)
        done = 0
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                g = refs[ref]
                _place(rows, tasks, g, partial(ray.get, ref))
                done += len(g)
            if progress:
                progress(done, len(tasks))
        return [r for r in rows if r is not None]
    finally:
        if started:
            ray.shutdown()


# -- output -------------------------------------------------------------------------------------


def ranked(rows: Sequence[SweepRow], objective: str) -> list[SweepRow]:
    """Rows grouped by trace (in the order given), best objective first; failed last."""
    sign = -1.0 if objective in MAXIMISED else 1.0
    order = {t: i for i, t in enumerate(dict.fromkeys(r.trace for r in rows))}

    def key(r: SweepRow) -> tuple[int, int, float, str]:
        v = r.value(objective)
        return (order[r.trace], v is None, sign * v if v is not None else 0.0, _cfg(r.config))

    return sorted(rows, key=key)


def by_config(rows: Sequence[SweepRow], objective: str) -> list[tuple[str, float, int, int]]:
    """(config, mean objective over traces, traces, failures), best first."""
    sums: dict[str, list[float]] = {}
    fails: dict[str, int] = {}
    for r in rows:
        if r.recorded and not r.config:
            continue  # a per-trace baseline, not a grid point
        c = _cfg(r.config)
        v = r.value(objective)
        sums.setdefault(c, [])
        fails.setdefault(c, 0)
        if v is None:
            fails[c] += 1
        else:
            sums[c].append(v)
    sign = -1.0 if objective in MAXIMISED else 1.0
    out = [(c, sum(v) / len(v), len(v), fails[c]) for c, v in sums.items() if v]
    return sorted(out, key=lambda x: (sign * x[1], x[0]))


def format_table(rows: Sequence[SweepRow], objective: str) -> str:
    shown = [objective] + [k for k in _SHOWN if k != objective]
    table: list[tuple[str, ...]] = [("trace", "config", *shown)]
    for r in ranked(rows, objective):
        name = Path(r.trace).name
        cfg = (_cfg(r.config) or "(recorded)") + (" *" if r.recorded else "")
        cfg += " ?" if r.untrusted else ""
        if r.metrics is None:
            table.append((name, cfg, "error: " + (r.error or ""), *[""] * (len(shown) - 1)))
            continue
        table.append((name, cfg, *(format_metric(k, r.metrics[k]) for k in shown)))
    lines = _grid(table)
    lines.append("* the trace's recorded config")
    if any(r.untrusted for r in rows):
        lines.append(f"? predicted with a step-time model of held-out R² below {TRUST_R2}")
    summary = by_config(rows, objective)
    if len({r.trace for r in rows}) > 1 and summary:
        lines += ["", f"configs by mean {objective} over traces:"]
        lines += _grid(
            [("config", f"mean {objective}", "traces", "failed")]
            + [(c, format_metric(objective, v), str(n), str(f)) for c, v, n, f in summary]
        )
    return "\n".join(lines)


def to_json(rows: Sequence[SweepRow], objective: str) -> list[dict[str, Any]]:
    return [asdict(r) for r in ranked(rows, objective)]


def to_csv(rows: Sequence[SweepRow], objective: str) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(("trace", "config", "recorded", *METRICS, "error"))
    for r in ranked(rows, objective):
        m = r.metrics or {}
        w.writerow(
            (
                r.trace,
                _cfg(r.config),
                int(r.recorded),
                *(m.get(k, "") for k in METRICS),
                r.error or "",
            )
        )
    return buf.getvalue()


def _cfg(config: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items())


def _grid(table: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = []
    for n, row in enumerate(table):
        lines.append(
            "  ".join(
                c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths))
            ).rstrip()
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines
