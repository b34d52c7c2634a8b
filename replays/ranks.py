"""A directory of one recording's data-parallel ranks, read side by side.

vLLM with data parallelism runs one engine core, so one scheduler, per rank; each writes
its own trace (`...-dpRANK.trace`, or a run directory `<stamp>-vllm_dpRANK-PID` of
segments). `schedtop info`/`stats`/`replay` given a directory that holds those rank
traces show them together: one column per rank, each figure computed by the same code
as that rank's own `schedtop stats` (so the columns equal the single-file outputs).

    ranks = find_ranks(directory)   # None: not a directory of rank traces
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import UserError
from recorder.errors import TraceError
from recorder.info import TraceSummary
from recorder.multi import open_trace, traces_in
from recorder.schema import Header, printable
from recorder.segments import is_run_dir
from replays.stats import TraceStats
from replays.storms import StormSummary

# The vLLM recorder names the rank in the header's engine (recorder/vllm/scheduler.py);
# older or renamed files still carry it in the file name (recorder/vllm/checks.py,
# recorder/vllm/live.py).
_HEADER_RANK = re.compile(r", DP rank (\d+)(?: of (\d+))?")
_FILE_RANK = re.compile(r"-dp(\d+)\.trace$")
_RUN_RANK = re.compile(r"-vllm_dp(\d+)-\d+$")


@dataclass(frozen=True, slots=True)
class RankTrace:
    """One rank's trace in the directory."""

    rank: int
    size: int | None  # the data-parallel size the header names (None: only the name has it)
    path: Path  # a trace file or a run directory


class RankError(UserError):
    """A directory that is not one recording's ranks."""


def find_ranks(directory: str | Path) -> list[RankTrace] | None:
    """The rank traces in `directory`, by rank; None when `directory` is not a directory
    of rank traces (a trace file, a run directory of segments, or one holding no trace
    with a rank: the callers read it as before). RankError when it mixes recordings."""
    d = Path(directory)
    if not d.is_dir() or is_run_dir(d):
        return None
    found = sorted(traces_in(d), key=lambda p: p.name)  # oldest first, as named
    ranked: list[tuple[RankTrace, Header]] = []
    unranked: list[Path] = []
    for path in found:
        n = (_RUN_RANK if path.is_dir() else _FILE_RANK).search(path.name)
        try:
            with open_trace(path) as reader:
                header = reader.header
        except TraceError:
            if n is not None:
                raise  # a rank's own trace is broken: that is the error to show
            unranked.append(path)  # some other file: not a rank either way
            continue
        m = _HEADER_RANK.search(header.engine)
        if m is not None:
            size = int(m.group(2)) if m.group(2) else None  # a dense model's: unknown
            ranked.append((RankTrace(int(m.group(1)), size, path), header))
        elif n is not None:
            ranked.append((RankTrace(int(n.group(1)), None, path), header))
        else:
            unranked.append(path)
    if not ranked:
        return None
    if unranked:
        raise RankError(
            f"{d}: mixes unrelated recordings: {unranked[0].name} is not a data-parallel "
            f"rank (keep one recording's rank files in a directory of their own)"
        )
    first_rank, first = ranked[0]
    by_rank: dict[int, RankTrace] = {}
    for r, h in ranked:
        if r.rank in by_rank:
            raise RankError(
                f"{d}: mixes unrelated recordings: rank {r.rank} twice "
                f"({by_rank[r.rank].path.name}, {r.path.name})"
            )
        what = _differs(first, h, first_rank, r)
        if what:
            raise RankError(
                f"{d}: mixes unrelated recordings: {r.path.name} has another {what} "
                f"than {first_rank.path.name}"
            )
        by_rank[r.rank] = r
    return [by_rank[k] for k in sorted(by_rank)]


def _differs(a: Header, b: Header, ra: RankTrace, rb: RankTrace) -> str:
    """What tells two ranks' headers apart as different recordings ("" when nothing).
    The pool's size is left out: each rank's engine core sizes its own KV cache."""
    if _HEADER_RANK.sub("", a.engine) != _HEADER_RANK.sub("", b.engine):
        return "engine"
    if a.model != b.model:
        return "model"
    if ra.size is not None and rb.size is not None and ra.size != rb.size:
        return "data-parallel size"
    ca = {k: v for k, v in a.config.items() if k != "num_blocks"}
    cb = {k: v for k, v in b.config.items() if k != "num_blocks"}
    if (ca, a.block_size, a.policy, a.redacted, a.kv_pool) != (
        cb,
        b.block_size,
        b.policy,
        b.redacted,
        b.kv_pool,
    ):
        return "configuration"
    return ""


def missing_ranks(ranks: list[RankTrace]) -> list[int]:
    """Ranks the headers' data-parallel size says exist but the directory lacks."""
    size = max((r.size for r in ranks if r.size is not None), default=0)
    have = {r.rank for r in ranks}
    return [k for k in range(size) if k not in have]


def rank_note(ranks: list[RankTrace], shown: int, directory: str) -> str:
    """The replay's note: which rank is shown and how to open the others."""
    others = ", ".join(f"{r.rank} ({r.path.name})" for r in ranks if r.rank != shown)
    return printable(
        f"data-parallel rank {shown} of {directory}; the other ranks: {others}. "
        f"Open one with: schedtop replay {directory} --rank R"
    )


def pick_rank(ranks: list[RankTrace], rank: int | None) -> RankTrace:
    """The rank to replay: `rank`, or the first. RankError for a rank not there."""
    if rank is None:
        return ranks[0]
    for r in ranks:
        if r.rank == rank:
            return r
    have = ", ".join(str(r.rank) for r in ranks)
    raise RankError(f"--rank {rank}: no such rank in this directory (it has {have})")


# -- side by side ---------------------------------------------------------------------------


def _table(ranks: list[RankTrace], rows: list[tuple[str, list[str]]], missing: list[int]) -> str:
    head = ("", [f"rank {r.rank}" for r in ranks])
    rows = [head, ("trace", [r.path.name for r in ranks]), *rows]
    label = max(len(k) for k, _ in rows)
    widths = [max(len(v[i]) for _, v in rows) for i in range(len(ranks))]
    lines = [
        f"{k:<{label}}  " + "  ".join(f"{c:>{w}}" for c, w in zip(v, widths, strict=True))
        for k, v in rows
    ]
    if missing:
        lines.append(f"missing ranks: {', '.join(map(str, missing))} (no trace in this directory)")
    return printable("\n".join(line.rstrip() for line in lines))


def format_info(ranks: list[RankTrace], summaries: list[TraceSummary]) -> str:
    """`schedtop info DIR`: each rank's summary in a column."""
    h = summaries[0].header
    rows = [
        ("steps", [f"{s.last_step - s.first_step + 1:,}" for s in summaries]),
        ("first..last", [f"{s.first_step}..{s.last_step}" for s in summaries]),
        ("duration s", [f"{s.duration_s:.3f}" for s in summaries]),
        ("requests", [f"{s.num_arrivals:,}" for s in summaries]),
        ("finished", [f"{s.num_finishes:,}" for s in summaries]),
        ("preemptions", [f"{s.num_preemptions:,}" for s in summaries]),
        ("KV blocks", [f"{s.header.num_blocks:,}" for s in summaries]),
        ("bytes", [f"{s.size:,}" for s in summaries]),
        ("closed", [_closed(s) for s in summaries]),
    ]
    engine = _HEADER_RANK.sub("", h.engine)
    title = f"engine    {engine}" + (f"  model: {h.model}" if h.model else "")
    return printable(title) + "\n" + _table(ranks, rows, missing_ranks(ranks))


def _closed(s: TraceSummary) -> str:
    if s.closed_cleanly:
        return "yes, stopped early" if s.stopped else "yes"
    return "no (cut)" if s.cut is not None else "no footer"


def format_stats(
    ranks: list[RankTrace], stats: list[TraceStats], storms: list[StormSummary]
) -> str:
    """`schedtop stats DIR`: each rank's metrics in a column (engine.metrics' figures,
    as each rank's own `schedtop stats` prints them)."""
    u = stats[0].unit

    def v(x: float | None) -> str:
        if x is None:
            return "-"
        return f"{x * 1e3:.1f} ms" if u == "s" else f"{x:.2f} steps"

    rate = "tokens/s" if u == "s" else "tokens/step"
    rows = [
        ("steps", [f"{s.num_steps}" for s in stats]),
        ("requests", [f"{s.num_requests}" for s in stats]),
        ("finished", [f"{s.num_finished}" for s in stats]),
        ("output tokens", [f"{s.output_tokens}" for s in stats]),
        (f"throughput {rate}", [f"{s.throughput:.2f}" for s in stats]),
        ("TTFT p50", [v(s.ttft_p50) for s in stats]),
        ("TTFT p99", [v(s.ttft_p99) for s in stats]),
        ("TPOT p50", [v(s.tpot_p50) for s in stats]),
        ("TPOT p99", [v(s.tpot_p99) for s in stats]),
        ("preemptions", [f"{s.preemptions}" for s in stats]),
        ("prefix-hit rate", [f"{s.prefix_hit_rate:.1%}" for s in stats]),
        ("peak KV blocks", [f"{s.peak_blocks} of {s.usable_blocks}" for s in stats]),
        ("budget use", [f"{s.mean_budget_use:.1%}" for s in stats]),
        ("preemptions/1k steps", [f"{t.per_1k_steps:.1f}" for t in storms]),
    ]
    return _table(ranks, rows, missing_ranks(ranks))


def stats_json(
    ranks: list[RankTrace], stats: list[TraceStats], storms: list[StormSummary]
) -> dict[str, Any]:
    """`schedtop stats DIR --json`: per rank, exactly what `stats RANK --json` prints."""
    return {
        "ranks": [
            {"rank": r.rank, "trace": str(r.path), "stats": {**s.to_json(), "storm": t.to_json()}}
            for r, s, t in zip(ranks, stats, storms, strict=True)
        ],
        "missing_ranks": missing_ranks(ranks),
    }
