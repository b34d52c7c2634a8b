"""The prefix cache made visible (issue 27 item 4), on the recorded prefix-thrash incident
(three 256-token system prompts taking turns in a pool that cannot keep two cached): hits
and misses at admission and evictions of cached blocks, whose and for whom, in the event
log; the hit rate in the history; the shared prefixes the cache lost in the incidents
view."""

from __future__ import annotations

from pathlib import Path

from recorder.reader import TraceReader
from replays.queueing import QueueScan
from replays.stats import trace_stats
from replays.timeline import Timeline
from tests.helpers import open_reader
from tests.tui_support import app_test, at_step, make_app, screen_text, wait_until
from tui.history import Digest, History
from tui.screens.incidents import IncidentsScreen
from tui.viewmodel import hit_rates
from tui.widgets.sparks import Sparklines

THRASH = Path(__file__).resolve().parent.parent / "replays" / "incidents" / "prefix_thrash.trace"


def _digests() -> tuple[Digest, ...]:
    tl = Timeline(open_reader(THRASH))
    h = History()
    h.prefix_caching = True
    h.fill(tl, tl.first_step, tl.last_step)
    return h.window(tl.first_step, tl.last_step)


def _events(ds: tuple[Digest, ...], kind: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for d in ds:
        for e in d.events:
            if e.kind == kind:
                out.setdefault(e.step, []).append(e.text)
    return out


def test_admissions_say_hit_or_miss_and_evictions_whose_and_for_whom() -> None:
    ds = _digests()
    admits = _events(ds, "admit")
    assert admits[0] == ["t00 admitted: prefix miss, 280 tokens to compute"]
    assert admits[90] == ["t03 admitted: prefix hit, 32 of 280 tokens cached"]
    evicts = _events(ds, "evict")
    # t02's prompt takes t00's cached system prompt: the loss t03 meets at step 90
    assert evicts[60] == ["15 cached blocks evicted (15 of t00) for t02"]
    assert evicts[90] == ["15 cached blocks evicted (15 of t01) for t03"]
    assert sum(d.evicted for d in ds) == sum(len(b) for b in _evicted_blocks())


def _evicted_blocks() -> list[tuple[int, ...]]:
    from recorder.schema import KVKind

    out = []
    with TraceReader(THRASH) as r:
        for rec in r.steps():
            for kind, _, blocks, _, _ in rec.kv_events.rows():
                if kind == KVKind.EVICTED:
                    out.append(blocks)
    return out


def test_the_hit_rate_is_the_folds() -> None:
    """Over the whole trace the digests' hits and lookups give stats' prefix-hit rate."""
    ds = _digests()
    s = trace_stats(THRASH)
    hits, queries = sum(d.hit_tokens for d in ds), sum(d.query_tokens for d in ds)
    assert hits == s.prefix_hit_tokens
    assert hits / queries == s.prefix_hit_rate
    rates = hit_rates(ds, window=len(ds))
    assert rates[-1] == 100 * s.prefix_hit_rate
    window = hit_rates(ds, window=32)
    assert window[0] == 0.0 and max(window) > 0  # the early misses, then the partial hits


def test_without_prefix_caching_no_miss_is_claimed() -> None:
    tl = Timeline(open_reader(THRASH))
    h = History()  # prefix_caching False
    h.fill(tl, 0, 0)
    assert [e.text for e in h.window(0, 0)[0].events if e.kind == "admit"] == ["t00 admitted"]


def test_the_scan_names_the_shared_prefixes_the_cache_lost() -> None:
    q = QueueScan(open_reader(THRASH))
    q.advance()
    losses = q.cache_losses()
    assert [c.first for c in losses] == ["t00", "t01", "t02"]
    first = losses[0]
    assert (first.sharers, first.losses, first.first_loss_step, first.first_loss) == (
        3,
        3,
        90,
        "t03",
    )
    assert first.shared_tokens == 3 * 256 and first.hit_tokens == 3 * 32
    assert "num_blocks" in first.knob


@app_test
async def test_the_views_show_the_cache() -> None:
    app = make_app(THRASH)
    async with app.run_test(size=(120, 40)) as pilot:
        await at_step(pilot, 0)
        await pilot.press("g")
        await pilot.press(*"90", "enter")
        await at_step(pilot, 90)
        text = screen_text(app)
        assert "t03 admitted: prefix hit, 32 of 280 tokens cached" in text
        assert "15 cached blocks evicted (15 of t01) for t03" in text
        sparks = app.query_one(Sparklines)
        assert sparks.vm is not None and sparks.vm.series[-1].name == "prefix hit"
        assert "prefix hit" in text
        await pilot.press("i")
        await wait_until(pilot, lambda: isinstance(app.screen, IncidentsScreen))
        screen = app.screen
        assert isinstance(screen, IncidentsScreen)
        await wait_until(pilot, lambda: screen.vm is not None and screen.vm.done)
        await wait_until(pilot, lambda: "prefix cache lost" in screen_text(app))
        text = screen_text(app)
        assert "prefix cache lost t00's prefix 3 of 3 times from step 90 (t03), 2 more" in text
        assert "└ 12% of 768 shared tokens hit → num_blocks/kv_cache_memory" in text
