"""What a server's CLIENT records add to a trace (`schedtop serve`): HTTP status counts,
requests whose client went away, and the timings clients saw (queue, TTFT, ITL, end to
end), for `schedtop stats` and the TUI. The timings' definitions (vllm bench serve's) are
engine.metrics' `client_metrics`, beside the engine side's."""

from __future__ import annotations

from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from engine.metrics import ClientRequest, client_metrics, latencies_of
from recorder.errors import TraceError
from recorder.reader import TraceReader
from recorder.schema import Client, RecordType, percentile
from recorder.segments import list_segments


@dataclass
class ServerStats:
    """The HTTP side of a server's trace: counts and client-side latencies (seconds), as
    `vllm bench serve` defines them (docs/metrics.md)."""

    http_requests: int  # responses recorded
    statuses: dict[int, int]  # responses per HTTP status code
    ok: int  # 2xx responses
    client_errors: int  # 4xx responses (bad requests, auth, a client gone before a reply)
    server_errors: int  # 5xx responses (overload, ...)
    aborted: int  # requests whose client went away before the end
    queue_p50: float | None  # arrival -> first scheduled
    queue_p99: float | None
    ttft_p50: float | None  # arrival -> first token sent
    ttft_p99: float | None
    itl_p50: float | None  # between two token chunks sent
    itl_p99: float | None
    e2e_p50: float | None  # arrival -> response ended
    e2e_p99: float | None
    endpoints: dict[str, int] = field(default_factory=dict)  # responses per route
    tpot_p50: float | None = None  # (e2e - TTFT) / (output tokens - 1), >= 2 tokens
    tpot_p99: float | None = None


def responses(records: Iterable[Client]) -> list[Client]:
    """One record per HTTP response: the choices of a request with n > 1 each have a
    record (their own timings, for the latencies) under one parent_id, and count once."""
    seen: set[str] = set()
    out: list[Client] = []
    for c in records:
        if c.parent_id:
            if c.parent_id in seen:
                continue
            seen.add(c.parent_id)
        out.append(c)
    return out


def server_stats(clients: Iterable[Client]) -> ServerStats | None:
    """None for a trace without CLIENT records (not written by a server). The counts are
    per HTTP response; the latencies per engine request (each choice of an n > 1
    request: its own TTFT and ITL, as vLLM's per-request metrics count them)."""
    records = list(clients)
    if not records:
        return None
    answered = responses(records)
    statuses = Counter(c.status for c in answered)
    m = client_metrics(
        ClientRequest(
            None if c.queue_ns is None else c.queue_ns / 1e9,
            None if c.ttft_ns is None else c.ttft_ns / 1e9,
            [g / 1e9 for g in c.itl_ns],
            c.e2e_ns / 1e9 if c.finish_reason not in ("", "abort") else None,
            c.completion_tokens,
        )
        for c in records
        if c.request_id  # it reached the engine
    )
    return ServerStats(
        http_requests=len(answered),
        statuses=dict(sorted(statuses.items())),
        ok=sum(n for s, n in statuses.items() if 200 <= s < 300),
        client_errors=sum(n for s, n in statuses.items() if 400 <= s < 500),
        server_errors=sum(n for s, n in statuses.items() if s >= 500),
        aborted=sum(1 for c in answered if c.finish_reason == "abort"),
        endpoints=dict(sorted(Counter(c.endpoint for c in answered).items())),
        **latencies_of(m),
    )


def format_server(s: ServerStats) -> list[tuple[str, str]]:
    """Rows for `schedtop stats`."""
    codes = ", ".join(f"{code}: {n}" for code, n in s.statuses.items() if code >= 400)
    return [
        (
            "HTTP responses",
            f"{s.http_requests} ({s.ok} 2xx, {s.client_errors} 4xx, {s.server_errors} 5xx"
            + (f"; {codes}" if codes else "")
            + ")",
        ),
        ("client aborts", f"{s.aborted}"),
        ("client queue p50 / p99", f"{_ms(s.queue_p50)} / {_ms(s.queue_p99)}"),
        ("client TTFT p50 / p99", f"{_ms(s.ttft_p50)} / {_ms(s.ttft_p99)}"),
        ("client TPOT p50 / p99", f"{_ms(s.tpot_p50)} / {_ms(s.tpot_p99)}"),
        ("client ITL p50 / p99", f"{_ms(s.itl_p50)} / {_ms(s.itl_p99)}"),
        ("client e2e p50 / p99", f"{_ms(s.e2e_p50)} / {_ms(s.e2e_p99)}"),
    ]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


class ClientLog:
    """The CLIENT records of a trace file or of a run directory's segments, read as they
    grow (the TUI's live mode) and looked up by step: what had happened on the HTTP side
    by the end of a step."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.records: list[Client] = []
        self._after: list[int] = []  # each record's after_step, ascending
        self._offsets: dict[Path, int] = {}  # per file: where the next read starts
        self._done: set[Path] = set()  # segments read to their END record

    def _files(self) -> list[Path]:
        if not self.path.is_dir():
            return [self.path]
        return [s.path for s in list_segments(self.path)]

    def refresh(self) -> int:
        """Read what was appended since the last call; the number of new records."""
        new = 0
        for path in self._files():
            if path in self._done:
                continue
            try:
                with TraceReader(path) as reader:
                    found, end = reader.records_of(
                        RecordType.CLIENT, self._offsets.get(path), tail=True
                    )
                    if reader.finished:
                        self._done.add(path)
            except FileNotFoundError:  # a segment deleted by rotation
                continue
            except TraceError as e:
                if e.incomplete:  # a segment whose header is still being written
                    continue
                raise
            self._offsets[path] = end
            for entry in found:
                self._add(entry.record)
                new += 1
        return new

    def _add(self, rec: object) -> None:
        assert isinstance(rec, Client)
        self.records.append(rec)
        # A record written before a later one names an earlier or equal step.
        self._after.append(max(rec.after_step, self._after[-1] if self._after else -1))

    def upto(self, step: int) -> list[Client]:
        """The records written by the end of `step`."""
        return self.records[: bisect_right(self._after, step)]

    def summary(self, step: int) -> str:
        """One header line's worth: "HTTP 120 ok · 3 4xx · 1 5xx · 4 left" ("" if none)."""
        seen = responses(self.upto(step))
        if not seen:
            return ""
        ok = sum(1 for c in seen if 200 <= c.status < 300 and c.finish_reason != "abort")
        parts = [f"HTTP {ok} ok"]
        bad4 = sum(1 for c in seen if 400 <= c.status < 500 and c.finish_reason != "abort")
        bad5 = sum(1 for c in seen if c.status >= 500)
        left = sum(1 for c in seen if c.finish_reason == "abort")
        if bad4:
            parts.append(f"{bad4} 4xx")
        if bad5:
            parts.append(f"{bad5} 5xx")
        if left:
            parts.append(f"{left} left")
        return " · ".join(parts)

    def timings(self, request_id: str, step: int) -> str:
        """A request's client-side timings, once its response ended by `step` ("" before)."""
        for c in reversed(self.upto(step)):
            if c.request_id == request_id:
                itl = percentile([g / 1e9 for g in c.itl_ns], 50)
                return (
                    f"client: queue {_ms(None if c.queue_ns is None else c.queue_ns / 1e9)}, "
                    f"TTFT {_ms(None if c.ttft_ns is None else c.ttft_ns / 1e9)}, "
                    f"ITL p50 {_ms(itl)}, HTTP {c.status}"
                    + (" (client left)" if c.finish_reason == "abort" else "")
                )
        return ""
