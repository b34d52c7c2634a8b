"""The view-model: what the screen shows at one step, as frozen data, and the pure
reducer that builds it from a replayed state.

`build_frame(state, step, history, notes, ctx)` is a function of its arguments only: no
file, no clock, no Timeline. The worker calls it with the state it has just rebuilt and
hands the frame to the UI thread, whose widgets only render frames. Everything here is
immutable (tuples, frozen dataclasses, read-only mappings), so a frame can cross threads.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from recorder.schema import (
    KIND_LABELS,
    REASON_LABELS,
    STATUS_LABELS,
    Reason,
    RequestState,
    Status,
)
from replays.reducer import StepView
from replays.slots import SlotPool
from replays.state import State
from tui.format import short_id
from tui.history import Digest, Event
from tui.incidents import IncidentsVM
from tui.waits import Wait, breakdown

# Block classes in BlockMapVM.cls; the held ones (USED, SHARED) are those >= USED.
NULL, FREE, CACHED, USED, SHARED = range(5)

BATCH_KINDS = tuple(KIND_LABELS.values())
REASONS = REASON_LABELS
STATES = STATUS_LABELS
FINISHED_STATES = frozenset(v for k, v in STATUS_LABELS.items() if k > Status.PREEMPTED)


@dataclass(frozen=True, slots=True)
class HeaderVM:
    """The top lines: where we are and how the engine is doing."""

    trace: str  # the trace file's name
    step: int  # the step shown (first_step - 1: before any)
    first_step: int  # the trace's first step
    last_step: int  # its last step so far
    time_ns: int  # when the step ended, ns since recording started
    step_ns: int  # how long the step took (since the previous one ended)
    budget_used: int  # tokens scheduled this step
    budget: int  # the step's token budget
    running: int  # running requests after the step
    waiting: int  # waiting requests after the step
    max_num_seqs: int  # the config's cap on running requests (0: unknown)
    free_blocks: int  # free KV blocks after the step
    usable_blocks: int  # blocks that can be handed out (the null block excluded)
    tokens_per_s: float | None  # scheduled tokens per second over the recent steps
    mode: str  # LIVE, PAUSED, PLAYING or SEARCHING
    speed: float  # play speed, steps per second
    breakpoints: tuple[str, ...]  # active breakpoints, as spelled
    followed: str | None  # the request being followed
    live: bool  # the session follows a trace being written (live mode)
    ended: bool  # the writer closed the trace
    idle_s: float | None  # live: seconds without a new step, once that is noticeable
    search_at: int | None  # how far a running breakpoint search has got
    http: str = ""  # a server's trace: HTTP responses by the end of the step ("" if none)
    client: str = ""  # the followed request's client-side timings, once its response ended
    status: str = ""  # the newest navigation message (a breakpoint hit, following)
    queue_head: str = ""  # the waiting queue's head and what blocks it ("" when none waits)
    priority_policy: bool = False  # the trace's policy is `priority`: its column matters
    link: str = ""  # live over HTTP: CONNECTED, IDLE 12s, DISCONNECTED (retrying) ("": a file)
    window: str = ""  # what the live counters cover ("since attach"; "": the whole trace)


@dataclass(frozen=True, slots=True)
class RequestRow:
    """One request in the table: every unfinished one, and those that finished this step."""

    ref: int  # its ref in the trace (arrival order); also picks its colour
    request_id: str  # the engine's id
    state: str  # waiting, running, preempted, or how it finished (stopped, length, ...)
    computed: int  # tokens in the KV cache
    total: int  # prompt plus output tokens so far
    output: int  # output tokens so far
    max_tokens: int  # output tokens, at most
    blocks: int  # blocks in its table
    preemptions: int  # times preempted
    priority: int  # lower runs first under the priority policy
    queued: int | None  # steps from arrival to first admission (None: arrived before the trace)
    still_queued: bool  # never admitted yet: `queued` is still growing
    # steps to its first token, as engine.metrics counts them (stats, sim): arrival is the
    # end of the step before it arrived, the token the end of the step that sampled it, so
    # a token in its arrival step is 1 (None: none yet, or unknown)
    ttft: int | None
    scheduled: int  # tokens scheduled this step
    kind: str  # what those tokens are: prefill, chunk, decode, spec ("" for none)
    why: str  # why it got nothing, or less than it wanted, this step ("" when neither)
    wait: int | None = (
        None  # steps since it was last scheduled, preemptions included (None: not waiting)
    )
    wait_exact: bool = True  # False: it waited before the steps seen (at least `wait`)
    wait_ns: int | None = None  # time since it was last scheduled (None: unknown)
    wait_why: str = ""  # why it waited, step counts by reason ("47 steps no free KV, ...")


@dataclass(frozen=True, slots=True)
class BlockMapVM:
    """The KV block pool after the step, one entry per block id (read-only sequences:
    copies made with C-level operations, so that large pools stay cheap)."""

    num_blocks: int  # blocks in the pool, the null block 0 included
    block_size: int  # tokens per block
    cls: bytes  # per block: NULL, FREE, CACHED (free, still hashed), USED or SHARED
    owner: Sequence[int]  # per block: the ref of the first table holding it (-1: none)
    index: Sequence[int]  # per block: its position in that table (-1: none)
    owners: Mapping[int, tuple[int, ...]]  # shared blocks: the refs of every table holding them
    tables: Mapping[int, tuple[int, ...]]  # each request's block table, by ref
    hashes: Mapping[int, bytes]  # blocks that hold a prefix hash
    free_links: Sequence[int]  # the free queue's next-links (index num_blocks: its head)
    # "tokens": SGLang's token pool slot by slot (format 1.9): a "block" is one token slot,
    # CACHED the radix cache's slots that no running request uses (evictable), and the
    # free slots have no order (free_links empty)
    pool: str = "blocks"


@dataclass(frozen=True, slots=True)
class BatchEntry:
    """One request's share of the step's batch."""

    ref: int  # request
    request_id: str  # its id
    kind: str  # prefill, chunk, decode or spec
    tokens: int  # tokens computed this step
    spec: int  # draft tokens among them
    accepted: int = -1  # drafts the verification accepted (-1: no drafts)


@dataclass(frozen=True, slots=True)
class BatchVM:
    """The step's batch against its token budget."""

    budget: int  # the token budget
    entries: tuple[BatchEntry, ...]  # in scheduling order (running first, then admitted)
    by_kind: tuple[tuple[str, int], ...]  # tokens per kind, in BATCH_KINDS order


@dataclass(frozen=True, slots=True)
class Series:
    """One sparkline's values, one per step of the window."""

    name: str  # its label
    values: tuple[float, ...]  # per step, oldest first
    unit: str  # how to print a value: "" (count), "ms" or "%"


@dataclass(frozen=True, slots=True)
class SparksVM:
    """Recent history around the cursor."""

    first: int  # the step of every series' first value
    cursor: int  # the index of the shown step in the values (-1: not in the window)
    series: tuple[Series, ...]  # running, waiting, free blocks, step time, preemptions


@dataclass(frozen=True, slots=True)
class Frame:
    """Everything the screen shows at one step."""

    seq: int  # frames built so far by this session (tests wait on it)
    header: HeaderVM  # the top lines
    requests: tuple[RequestRow, ...]  # by ref
    blocks: BlockMapVM  # the block map
    batch: BatchVM  # the batch composition
    sparks: SparksVM  # the sparklines
    events: tuple[Event, ...]  # the event log, oldest first
    incidents: IncidentsVM | None = None  # every preemption, abort and error found so far


@dataclass(frozen=True, slots=True)
class StepInput:
    """The shown step spelled out, plus what the state after it no longer has."""

    view: StepView  # the step record with its implicit parts made explicit
    gone: tuple[RequestState, ...]  # requests that finished in the step, as they were before it


@dataclass(frozen=True, slots=True)
class Context:
    """The session's settings and the trace's extent, which the state does not hold."""

    seq: int  # the frame's number
    trace: str  # the trace file's name
    first_step: int  # the trace's first step
    last_step: int  # its last step so far
    max_num_seqs: int  # from the header's config (0: unknown)
    mode: str  # LIVE, PAUSED, PLAYING or SEARCHING
    speed: float  # play speed, steps per second
    breakpoints: tuple[str, ...]  # active breakpoints
    followed: str | None  # the followed request
    live: bool  # a trace being written
    ended: bool  # the writer closed the trace
    idle_s: float | None  # live: seconds without a new step
    search_at: int | None  # a running search's position
    step_ns: int = 0  # how long the step took (from the records: no history needed)
    tokens_per_s: float | None = None  # scheduled tokens per second over recent steps
    max_events: int = 200  # event log lines kept
    http: str = ""  # a server's trace: HTTP responses by the end of the step
    client: str = ""  # the followed request's client-side timings
    status: str = ""  # the newest navigation message, for the status line
    priority_policy: bool = False  # the trace's policy is `priority`
    link: str = ""  # live over HTTP: the connection's state, in words
    window: str = ""  # what the live counters cover ("": the whole trace)


def build_frame(
    state: State,
    step: StepInput | None,
    history: Sequence[Digest],
    log: Sequence[Digest],
    notes: Sequence[Event],
    ctx: Context,
    waits: Mapping[int, Wait] | None = None,
) -> Frame:
    """The frame for the state after `step` (None: before the first step). `history` holds
    the digests of the sparklines' window of steps around it, `log` those of the steps up
    to it whose events the log shows, both in order; `notes` are the session's own events
    (breakpoint hits), merged into the log by step; `waits` the requests' waits (by ref,
    from tui.waits)."""
    return Frame(
        ctx.seq,
        _header(state, step, ctx),
        _rows(state, step, waits or {}),
        _blocks(state),
        _batch(step),
        _sparks(state.step, history),
        _events(state.step, log, notes, ctx.max_events),
    )


# -- header ------------------------------------------------------------------------------------


def _header(state: State, step: StepInput | None, ctx: Context) -> HeaderVM:
    rec = None if step is None else step.view.record
    return HeaderVM(
        trace=ctx.trace,
        step=state.step,
        first_step=ctx.first_step,
        last_step=ctx.last_step,
        time_ns=0 if rec is None else rec.time_ns,
        step_ns=ctx.step_ns,
        budget_used=0 if rec is None else rec.num_scheduled_tokens,
        budget=0 if rec is None else rec.token_budget,
        running=len(state.running),
        waiting=len(state.waiting),
        max_num_seqs=ctx.max_num_seqs,
        # a token pool's (format 1.9): the slots a new request could get, free or evictable
        free_blocks=(
            len(state.free) if state.slots is None else state.slots.num_free + state.slots.evictable
        ),
        usable_blocks=state.num_blocks - 1,
        tokens_per_s=ctx.tokens_per_s,
        mode=ctx.mode,
        speed=ctx.speed,
        breakpoints=ctx.breakpoints,
        followed=ctx.followed,
        live=ctx.live,
        ended=ctx.ended,
        idle_s=ctx.idle_s,
        search_at=ctx.search_at,
        http=ctx.http,
        client=ctx.client,
        status=ctx.status,
        queue_head=queue_head(state, step),
        priority_policy=ctx.priority_policy,
        link=ctx.link,
        window=ctx.window,
    )


def queue_head(state: State, step: StepInput | None) -> str:
    """The waiting queue's head and, when the waiting pass stopped at it, what blocks it:
    "r13 needs 9 blocks, 4 free" for a pool too full, else the stop's reason."""
    if not state.waiting:
        return ""
    r = state.requests[state.waiting[0]]
    rid = short_id(r.request_id)  # a title has no room for a whole OpenAI id
    stop = None if step is None else step.view.record.waiting_stop
    if stop is None:
        return f"queue head {rid}"
    if stop.head in (Reason.KV_BLOCKS, Reason.WATERMARK, Reason.FULL_PROMPT):
        need = -(-r.num_tokens // state.block_size) - len(r.block_ids)
        return f"queue head {rid} needs {need} blocks, {len(state.free)} free"
    return f"queue head {rid}: {REASONS.get(stop.head, f'reason {stop.head}')}"


# -- requests ------------------------------------------------------------------------------------


def _rows(
    state: State, step: StepInput | None, waits: Mapping[int, Wait]
) -> tuple[RequestRow, ...]:
    sched: dict[int, tuple[int, str]] = {}  # ref -> (tokens, kind)
    why: dict[int, str] = {}
    if step is not None:
        for e in step.view.scheduled:
            sched[e.ref] = (e.num_tokens, KIND_LABELS.get(e.kind, "?"))
        why = reasons(state, step.view)
    i = state.step
    none = (0, "")
    states = STATES
    rows = []
    # The hot loop (a thousand requests a frame): positional fields, no helper calls.
    for ref, r in state.requests.items():
        arrived, first, token = r.arrival_step, r.first_scheduled_step, r.first_token_step
        tokens, kind = sched.get(ref, none)
        output = r.num_output_tokens
        w = waits.get(ref)
        rows.append(
            RequestRow(
                ref,
                r.request_id,
                states.get(r.status, "?"),
                r.num_computed_tokens,
                r.num_prompt_tokens + output,
                output,
                r.max_tokens,
                len(r.block_ids),
                r.num_preemptions,
                r.priority,
                None if arrived < 0 else (first - arrived if first >= 0 else i + 1 - arrived),
                arrived >= 0 > first,
                token - arrived + 1 if arrived >= 0 and token >= 0 else None,
                tokens,
                kind,
                why.get(ref, ""),
                None if w is None else w.steps,
                True if w is None else w.exact,
                None if w is None else w.time_ns,
                "" if w is None else breakdown(w),
            )
        )
    if step is not None and step.gone:
        rows.extend(_finished_row(r, i, step.view, sched.get(r.ref)) for r in step.gone)
        rows.sort(key=lambda row: row.ref)
    return tuple(rows)


def _finished_row(
    r: RequestState, step: int, view: StepView, sched: tuple[int, str] | None
) -> RequestRow:
    """A request that finished in `step`; `r` is how it was before the step."""
    f = next(f for f in view.record.finishes if f.ref == r.ref)
    how = STATES.get(f.status, "finished")
    computed = r.num_computed_tokens
    entry = next((e for e in view.scheduled if e.ref == r.ref), None)
    if entry is not None:
        computed = entry.num_computed_before + entry.num_tokens
    output = r.num_output_tokens + sum(s.count for s in view.samples if s.ref == r.ref)
    arrived, first, token = r.arrival_step, r.first_scheduled_step, r.first_token_step
    if first < 0 and any(a.ref == r.ref for a in view.record.admissions):
        first = step  # admitted and finished in the same step
    if token < 0 and output > 0:
        token = step
    queued = None if arrived < 0 else (first if first >= 0 else step + 1) - arrived
    tokens, kind = sched if sched is not None else (0, "")
    return RequestRow(
        r.ref,
        r.request_id,
        how,
        computed,
        r.num_prompt_tokens + output,
        output,
        r.max_tokens,
        0,  # its blocks are freed in its last step
        r.num_preemptions,
        r.priority,
        queued,
        False,
        token - arrived + 1 if arrived >= 0 and token >= 0 else None,
        tokens,
        kind,
        f"finished: {how}" + (f" ({f.message})" if f.message else ""),
    )


def reasons(state: State, view: StepView) -> dict[int, str]:
    """Why each request got nothing (or less than it wanted) this step, by ref: its own
    shortfall, its preemption, or the reason its queue's pass stopped (QueueStop: the
    first request left behind gets `head`, every one after it `rest`)."""
    rec = view.record
    names = view.names
    why: dict[int, str] = {}
    for s in rec.shortfalls:
        text = REASONS.get(s.reason, f"reason {s.reason}")
        why[s.ref] = text if s.got == 0 else f"{text} ({s.got}/{s.wanted})"
    for p in rec.preemptions:
        why[p.victim] = (
            "preempted itself (no KV)"
            if p.victim == p.for_request
            else f"preempted for {names.get(p.for_request, p.for_request)}"
        )
    scheduled = {e.ref for e in view.scheduled}
    for stop, queue in ((rec.running_stop, state.running), (rec.waiting_stop, state.waiting)):
        if stop is None:
            continue
        left = [ref for ref in queue if ref not in scheduled and ref not in why]
        for i, ref in enumerate(left):
            reason = stop.head if i == 0 else stop.rest
            why[ref] = REASONS.get(reason, f"reason {reason}")
    return why


# -- blocks --------------------------------------------------------------------------------------


def _blocks(state: State) -> BlockMapVM:
    if state.slots is not None:
        return _slots(state.slots)
    n = state.num_blocks
    cls = bytearray([FREE]) * n
    cls[0] = NULL
    owner = array("i", [-1]) * n
    index = array("i", [-1]) * n
    shared: dict[int, tuple[int, ...]] = {}
    tables: dict[int, tuple[int, ...]] = {}
    for ref, r in state.requests.items():
        table = tables[ref] = tuple(r.block_ids)
        for i, b in enumerate(table):
            if owner[b] < 0:
                owner[b], index[b], cls[b] = ref, i, USED
            else:
                shared[b] = (*shared.get(b, (owner[b],)), ref)
                cls[b] = SHARED
    hashes = state.block_hashes
    for b in hashes:
        if cls[b] == FREE:
            cls[b] = CACHED
    return BlockMapVM(
        n,
        state.block_size,
        bytes(cls),
        _frozen(owner),
        _frozen(index),
        MappingProxyType(shared),
        MappingProxyType(tables),
        MappingProxyType(dict(hashes)),
        _frozen(state.free.next[:]),
    )


_FREE_CLASS = bytes.maketrans(b"\x00\x01", bytes([CACHED, FREE]))


def _slots(pool: SlotPool) -> BlockMapVM:
    """SGLang's token pool as a block map of one-token blocks: a slot in a running
    request's row is USED (SHARED when several rows hold it: a radix-cache prefix), a free
    one FREE, and any other the radix cache's (CACHED: evictable, or kept for a request
    that is not running)."""
    n = pool.size
    # free or not, per slot, in one C-level pass (pools hold hundreds of thousands)
    cls = bytearray(pool.free.translate(_FREE_CLASS))
    cls[0] = NULL
    owner = array("i", [-1]) * n
    index = array("i", [-1]) * n
    shared: dict[int, tuple[int, ...]] = {}
    tables: dict[int, tuple[int, ...]] = {}
    for ref in sorted(pool.rows):
        tables[ref] = tuple(s for s in pool.rows[ref] if s)
        for i, b in enumerate(pool.rows[ref]):
            if not b:
                continue
            if owner[b] < 0:
                owner[b], index[b], cls[b] = ref, i, USED
            else:
                shared[b] = (*shared.get(b, (owner[b],)), ref)
                cls[b] = SHARED
    return BlockMapVM(
        n,
        1,
        bytes(cls),
        _frozen(owner),
        _frozen(index),
        MappingProxyType(shared),
        MappingProxyType(tables),
        MappingProxyType({}),
        (),
        "tokens",
    )


def _frozen(a: array[int]) -> Sequence[int]:
    """A read-only view of `a` (which nobody else holds): indexable like a tuple."""
    return memoryview(a).toreadonly()


# -- batch ---------------------------------------------------------------------------------------


def _batch(step: StepInput | None) -> BatchVM:
    if step is None:
        return BatchVM(0, (), tuple((k, 0) for k in BATCH_KINDS))
    names = step.view.names
    accepted = {a.ref: a.accepted for a in step.view.record.spec_accepted}
    entries = tuple(
        BatchEntry(
            e.ref,
            names.get(e.ref, str(e.ref)),
            KIND_LABELS.get(e.kind, "?"),
            e.num_tokens,
            e.num_spec_tokens,
            accepted.get(e.ref, -1),
        )
        for e in step.view.scheduled
    )
    totals = dict.fromkeys(BATCH_KINDS, 0)
    for e in entries:
        # A verifying entry is a decode token plus its drafts: count each as its kind.
        kind = "decode" if e.kind == "spec" else e.kind
        totals[kind] = totals.get(kind, 0) + e.tokens - e.spec
        totals["spec"] += e.spec
    return BatchVM(
        step.view.record.token_budget, entries, tuple((k, totals[k]) for k in BATCH_KINDS)
    )


# -- history -------------------------------------------------------------------------------------


SERIES = (
    ("running", ""),
    ("waiting", ""),
    ("free blocks", ""),
    ("step time", "ms"),
    ("preempted", ""),
    ("prefix hit", "%"),
)
HIT_WINDOW = 32  # steps the prefix-hit rate is taken over (one step rarely admits anyone)


def hit_rates(history: Sequence[Digest], window: int = HIT_WINDOW) -> tuple[float, ...]:
    """Per step, the prefix-cache hit rate (%) of the first admissions over the `window`
    steps ending there (vLLM's rate: tokens found cached over tokens looked up); 0 where
    none was admitted in that window."""
    out: list[float] = []
    hits = queries = 0
    for i, d in enumerate(history):
        hits += d.hit_tokens
        queries += d.query_tokens
        if i >= window:
            old = history[i - window]
            hits -= old.hit_tokens
            queries -= old.query_tokens
        out.append(100.0 * hits / queries if queries else 0.0)
    return tuple(out)


def _sparks(step: int, history: Sequence[Digest]) -> SparksVM:
    if not history:
        return SparksVM(step, -1, tuple(Series(name, (), unit) for name, unit in SERIES))
    first = history[0].step
    cursor = step - first if first <= step <= history[-1].step else -1
    columns = (
        tuple(float(d.running) for d in history),
        tuple(float(d.waiting) for d in history),
        tuple(float(d.free_blocks) for d in history),
        tuple(d.step_ns / 1e6 for d in history),
        tuple(float(d.preemptions) for d in history),
        hit_rates(history),
    )
    return SparksVM(
        first,
        cursor,
        tuple(Series(name, values, unit) for (name, unit), values in zip(SERIES, columns)),
    )


def _events(
    step: int, history: Sequence[Digest], notes: Sequence[Event], limit: int
) -> tuple[Event, ...]:
    """The log up to the shown step: the steps' events and the notes, oldest first."""
    out: list[Event] = []
    for d in history:
        if d.step > step:
            break
        out.extend(d.events)
    out.extend(n for n in notes if n.step <= step)
    out.sort(key=lambda e: e.step)  # stable: a step's notes stay after its events
    return tuple(out[-limit:])


# -- what the UI asks of a frame -------------------------------------------------------------------


SORT_KEYS = (
    "arrival",
    "id",
    "state",
    "tokens",
    "blocks",
    "preempted",
    "priority",
    "wait",
    "queued",
    "ttft",
    "step",
)
# Numeric columns sort largest first on the first press: the worst is what one looks for.
NUMERIC_SORTS = frozenset(
    ("tokens", "blocks", "preempted", "priority", "wait", "queued", "ttft", "step")
)
_STATE_ORDER = {"running": 0, "preempted": 1, "waiting": 2}


def _sort_key(key: str):  # type: ignore[no-untyped-def]
    far = 1 << 60
    return {
        "arrival": lambda r: r.ref,
        "id": lambda r: r.request_id,
        "state": lambda r: (_STATE_ORDER.get(r.state, 3), r.ref),
        "tokens": lambda r: (r.computed, r.total),
        "blocks": lambda r: r.blocks,
        "preempted": lambda r: r.preemptions,
        "priority": lambda r: r.priority,
        "wait": lambda r: -1 if r.wait is None else r.wait,
        "queued": lambda r: far if r.queued is None else r.queued,
        "ttft": lambda r: far if r.ttft is None else r.ttft,
        "step": lambda r: r.scheduled,
    }[key]


def table_rows(
    rows: Sequence[RequestRow], query: str = "", sort: str = "arrival", reverse: bool = False
) -> tuple[RequestRow, ...]:
    """The rows the table shows: those matching every word of `query`, sorted by `sort`.
    A word matches a substring of the id, the state, the scheduled kind or the reason;
    `preempted` matches every request ever preempted, and `pre>N`, `wait>N` (or `<`)
    compare a count."""
    words = query.lower().split()
    if words:
        tests = [_word_test(w) for w in words]
        rows = [r for r in rows if all(t(r) for t in tests)]
    return tuple(sorted(rows, key=_sort_key(sort), reverse=reverse))


_COMPARE = re.compile(r"^(pre|wait|blocks)([<>])(\d+)$")


def _word_test(w: str) -> Callable[[RequestRow], bool]:
    m = _COMPARE.match(w)
    if m:
        field, op, n = m.group(1), m.group(2), int(m.group(3))

        def value(r: RequestRow) -> int:
            if field == "pre":
                return r.preemptions
            if field == "blocks":
                return r.blocks
            return -1 if r.wait is None else r.wait

        if op == ">":
            return lambda r: value(r) > n
        return lambda r: 0 <= value(r) < n
    if w in ("preempted", "pre"):
        return lambda r: r.preemptions > 0 or r.state == "preempted"
    return lambda r: w in r.request_id.lower() or w in r.state or w in r.kind or w in r.why.lower()


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """What the detail line says about one block."""

    block: int  # its id
    cls: int  # NULL, FREE, CACHED, USED or SHARED
    owners: tuple[str, ...]  # the ids of the requests whose tables hold it
    ref_cnt: int  # how many tables hold it
    hash: bytes | None  # its prefix hash, if it holds one
    tokens: tuple[int, int] | None  # the token positions it holds in its first owner [lo, hi)
    free_rank: int | None  # free blocks handed out before it (None: not free)


def block_info(frame: Frame, block: int) -> BlockInfo | None:
    """The selected block's details, or None when there is no such block."""
    vm = frame.blocks
    if not 0 <= block < vm.num_blocks:
        return None
    refs = vm.owners.get(block) or ((vm.owner[block],) if vm.owner[block] >= 0 else ())
    by_ref = {r.ref: r for r in frame.requests}
    names = tuple(by_ref[r].request_id if r in by_ref else f"#{r}" for r in refs)
    tokens = None
    if vm.index[block] >= 0:
        lo = vm.index[block] * vm.block_size
        first = by_ref.get(vm.owner[block])
        hi = lo + vm.block_size if first is None else min(lo + vm.block_size, first.total)
        tokens = (lo, max(lo, hi))
    rank = free_rank(vm, block) if vm.cls[block] in (FREE, CACHED) else None
    return BlockInfo(block, vm.cls[block], names, len(refs), vm.hashes.get(block), tokens, rank)


def free_rank(vm: BlockMapVM, block: int) -> int | None:
    """How many free blocks are handed out before `block` (None: it is not free)."""
    if not vm.free_links:  # a token pool's free slots have no order
        return None
    links, tail = vm.free_links, vm.num_blocks + 1
    node, rank = links[vm.num_blocks], 0
    while node != tail and rank <= vm.num_blocks:
        if node == block:
            return rank
        node, rank = links[node], rank + 1
    return None
