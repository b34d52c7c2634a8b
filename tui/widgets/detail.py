"""The line under the block map: the selected block's owners, ref count, hash and tokens,
or the legend when no block is selected."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive

from tui.viewmodel import CACHED, FREE, NULL, SHARED, USED, Frame, block_info
from tui.widgets import palette
from tui.widgets.blockmap import CACHED_RUN
from tui.widgets.lines import TextLines

_LEGEND = (
    (palette.OWNERS[3], "█", "used"),
    (palette.SHARED, "▓", "shared"),
    (palette.CACHED, "▒", "cached-free"),
    (palette.FREE, "·", "free"),
    (palette.NULL, "╳", "null"),
)


class BlockDetail(TextLines):
    """Details of the selected block (and of its cell's run of blocks when aggregated)."""

    DEFAULT_CSS = """
    BlockDetail { height: 2; }
    """

    frame: reactive[Frame | None] = reactive(None)
    block: reactive[int | None] = reactive(None)
    per_cell: reactive[int] = reactive(1)  # blocks the selected cell stands for
    aggregate: reactive[bool] = reactive(False)  # the map's cells stand for runs of blocks
    pool: reactive[str] = reactive("blocks")  # "tokens": SGLang's token pool (slots)

    def lines(self, width: int, height: int) -> list[Text]:
        frame, block = self.frame, self.block
        if frame is None or block is None:
            if self.pool == "tokens":
                return token_legend(self.per_cell if self.aggregate else 1)
            return aggregate_legend(self.per_cell) if self.aggregate else legend()
        lines = [describe(frame, block)]
        if self.per_cell > 2:
            lo = block - block % self.per_cell
            lines.append(run(frame, lo, min(lo + self.per_cell, frame.blocks.num_blocks)))
        return lines


def legend() -> list[Text]:
    t = Text()
    for colour, glyph, name in _LEGEND:
        t.append(glyph, style=colour)
        t.append(f" {name}  ")
    return [
        t,
        Text(
            "click a block (or j k h l) for its owners, hash and tokens; esc: legend",
            style="#7f848e",
        ),
    ]


def aggregate_legend(per_cell: int) -> list[Text]:
    """The aggregate zoom's legend: a cell's shade is how much of its run is held."""
    t = Text()
    t.append(f"a cell: {per_cell} blocks, held  ")
    for glyph, share in zip(_SHADES_SHOWN, ("¼", "½", "¾", "all")):
        t.append(glyph, style=palette.OWNERS[3])
        t.append(f" {share}  ")
    t.append(CACHED_RUN, style=palette.CACHED)
    t.append(" cached  ")
    t.append("·", style=palette.FREE)
    t.append(" free")
    return [t, Text("click a cell (or j k h l) for its blocks; esc: legend", style="#7f848e")]


_SHADES_SHOWN = "░▒▓█"
_TOKEN_LEGEND = (
    (palette.OWNERS[3], "█", "a request's"),
    (palette.SHARED, "▓", "shared prefix"),
    (palette.CACHED, "▒", "radix cache (evictable)"),
    (palette.FREE, "·", "free"),
)


def token_legend(per_cell: int) -> list[Text]:
    """SGLang's token pool (format 1.9): one cell a slot, or a run of `per_cell` slots
    (shaded by how much of it requests hold, as the block map's aggregate)."""
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("token pool (SGLang)", style="bold")
    t.append(f"  a cell: {per_cell} slots  " if per_cell > 1 else "  a cell: 1 slot  ")
    for colour, glyph, name in _TOKEN_LEGEND:
        t.append(CACHED_RUN if per_cell > 2 and glyph == "▒" else glyph, style=colour)
        t.append(f" {name}  ")
    hint = "click a cell (or j k h l) for its slot's owners; esc: legend"
    return [t, Text(hint, style="#7f848e")]


def describe(frame: Frame, block: int) -> Text:
    """One line about `block`."""
    info = block_info(frame, block)
    t = Text(no_wrap=True, overflow="ellipsis")
    if info is None:
        return t
    slots = frame.blocks.pool == "tokens"
    t.append(f"{'slot' if slots else 'block'} {info.block}", style="bold")
    t.append("  ")
    if info.cls == NULL:
        what = "the padding slot" if slots else "the null block: padding"
        t.append(f"{what}, never handed out", style=palette.NULL)
        return t
    if slots and info.cls in (FREE, CACHED):
        what = "the radix cache's, no running request uses it" if info.cls == CACHED else "free"
        t.append(what, style=palette.CACHED if info.cls == CACHED else palette.FREE)
    elif info.cls in (FREE, CACHED):
        what = "free, cached (evictable)" if info.cls == CACHED else "free"
        t.append(what, style=palette.CACHED if info.cls == CACHED else palette.FREE)
        t.append(f"  {info.free_rank} free blocks go before it")
    else:
        names = ", ".join(info.owners[:3]) + (
            f" +{len(info.owners) - 3}" if len(info.owners) > 3 else ""
        )
        colour = palette.SHARED if info.cls == SHARED else None
        t.append("shared by " if info.cls == SHARED else "held by ", style=colour)
        t.append(names, style="bold")
        t.append(f"  ref {info.ref_cnt}")
        if info.tokens is not None and slots:
            t.append(f"  token {info.tokens[0]}")
        elif info.tokens is not None:
            lo, hi = info.tokens
            t.append(f"  tokens {lo}–{hi - 1}" if hi > lo else f"  tokens from {lo} (empty)")
    if info.hash is not None:
        t.append(f"  hash {info.hash.hex()[:16]}", style="#7f848e")
    return t


def run(frame: Frame, lo: int, hi: int) -> Text:
    """One line about the blocks lo..hi-1 that an aggregated cell stands for."""
    classes = frame.blocks.cls[lo:hi]
    counts = {c: classes.count(c) for c in (USED, SHARED, CACHED, FREE)}
    t = Text(no_wrap=True, overflow="ellipsis")
    what = "slots" if frame.blocks.pool == "tokens" else "blocks"
    t.append(f"cell: {what} {lo}–{hi - 1}: ", style="#7f848e")
    t.append(
        f"{counts[USED] + counts[SHARED]} used ({counts[SHARED]} shared), "
        f"{counts[CACHED]} cached, {counts[FREE]} free"
    )
    return t
