"""Small pure formatters shared by the widgets."""

from __future__ import annotations


def si(value: float) -> str:
    """A count in at most five characters: 987, 12.3k, 4.56M."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            x = value / scale
            return f"{x:.1f}{unit}" if abs(x) < 100 else f"{x:.0f}{unit}"
    return f"{value:.0f}"


def duration(ns: int) -> str:
    """A step's duration: 850 µs, 2.31 ms, 1.20 s."""
    if ns < 1_000_000:
        return f"{ns / 1e3:.0f} µs"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.2f} s"


def clock(ns: int) -> str:
    """Time since the recording started: 12.345 s, 3:07.250, 1:02:03.5."""
    s = ns / 1e9
    if s < 60:
        return f"{s:.3f} s"
    m, s = divmod(s, 60)
    if m < 60:
        return f"{int(m)}:{s:06.3f}"
    h, m = divmod(int(m), 60)
    return f"{h}:{m:02d}:{s:04.1f}"


def parse_goto(text: str) -> tuple[str, int]:
    """What the go-to dialog asks for: ("step", N), ("move", ±N) or ("time", ns).

    `120` is step 120; `+10` / `-10` move; `1.5s`, `250ms`, `800us` are times since the
    recording started. ValueError says what is wrong."""
    t = text.strip().lower().replace(" ", "")
    if not t:
        raise ValueError("type a step number, +N / -N, or a time such as 1.5s or 250ms")
    for unit, scale in (("ms", 1e6), ("us", 1e3), ("µs", 1e3), ("ns", 1.0), ("s", 1e9)):
        if t.endswith(unit):
            number = t[: -len(unit)]
            try:
                value = float(number)
            except ValueError:
                raise ValueError(f"{text!r}: {number!r} is not a number") from None
            if value < 0:
                raise ValueError(f"{text!r}: a time is never negative")
            return "time", int(value * scale)
    try:
        n = int(t)
    except ValueError:
        raise ValueError(f"{text!r}: not a step, a move (+N, -N) or a time (1.5s, 250ms)") from None
    return ("move", n) if t[0] in "+-" else ("step", n)


ID_CELLS = 16  # an id in running text (events, titles) at most: `chatcmpl-…bbfe7`


def middle(text: str, width: int) -> str:
    """`text` in at most `width` characters, cut in the middle: a server's ids share
    their start (`chatcmpl-`) and differ at the end, so both ends are kept. The part up
    to the first `-` or `_` stays whole when it leaves room for 5 characters of the end:
    `chatcmpl-…bbfe7`."""
    if len(text) <= width:
        return text
    if width < 4:
        return text[:width]
    room = width - 1  # the ellipsis takes one
    cut = min((i for i in (text.find("-"), text.find("_")) if i >= 0), default=-1)
    head = cut + 1 if 0 < cut + 1 <= room - 5 else (room + 1) // 2
    return text[:head] + "…" + text[len(text) - (room - head) :]


def short_id(request_id: str) -> str:
    """A request id as running text names it: at most ID_CELLS characters."""
    return middle(request_id, ID_CELLS)


def shorten_ids(text: str, ids: tuple[str, ...]) -> str:
    """`text` with each of `ids` longer than ID_CELLS cut in the middle."""
    for rid in ids:
        if len(rid) > ID_CELLS:
            text = text.replace(rid, short_id(rid))
    return text
