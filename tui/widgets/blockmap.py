"""The KV block map: every block of the pool, coloured by the request that holds it.

Three zooms: one block per cell (each block's class told by its glyph), two blocks per
cell (half blocks: the left one in the foreground, the right one in the background), and
an aggregate that fits the whole pool in the pane (each cell summarises a run of blocks:
its shade says how full the run is, its colour who holds most of it). Drawn line by line,
so only the visible lines cost anything at 4096 blocks or more.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding
from textual.geometry import Region, Size
from textual.message import Message
from textual.reactive import reactive
from textual.scroll_view import ScrollView
from textual.strip import Strip

from tui.viewmodel import CACHED, FREE, NULL, SHARED, USED, BlockMapVM
from tui.widgets import palette

ZOOMS = ("block", "half", "fit")
ZOOM_TITLES = {"block": "1 block per cell", "half": "2 blocks per cell",
               "fit": "aggregate: {} blocks per cell"}
_GLYPHS = {NULL: "╳", FREE: "·", CACHED: "▒", USED: "█", SHARED: "▓"}
_SHADES = " ░▒▓█"
_LABEL = palette.style("#5c6370")
_CLASS_COLOURS = {NULL: palette.NULL, FREE: palette.FREE, CACHED: palette.CACHED,
                  SHARED: palette.SHARED}


@dataclass(frozen=True, slots=True)
class Geometry:
    """How the pool is laid out in the pane."""

    zoom: str  # block, half or fit
    cols: int  # cells per line
    per_cell: int  # blocks per cell
    lines: int  # lines the whole pool takes

    @property
    def per_line(self) -> int:
        return self.cols * self.per_cell

    def cell_of(self, block: int) -> tuple[int, int]:
        """(x, y) of the cell that shows `block`."""
        y, rest = divmod(block, self.per_line)
        return rest // self.per_cell, y


def geometry(num_blocks: int, cols: int, rows: int, zoom: str | None) -> Geometry:
    """The layout for `zoom` (None: the closest zoom at which the pool fits the pane)."""
    cols, rows = max(1, cols), max(1, rows)
    if zoom is None:
        zoom = ("block" if num_blocks <= cols * rows else
                "half" if num_blocks <= 2 * cols * rows else "fit")
    if zoom == "block":
        per_cell = 1
    elif zoom == "half":
        per_cell = 2
    else:
        per_cell = max(1, -(-num_blocks // (cols * rows)))
    per_line = cols * per_cell
    return Geometry(zoom, cols, per_cell, -(-num_blocks // per_line))


class BlockMap(ScrollView, can_focus=True, inherit_bindings=False):
    """The block pool. Click a cell (or move with the keys) to select a block."""

    DEFAULT_CSS = """
    BlockMap { height: 1fr; scrollbar-size-vertical: 1; overflow-x: hidden; }
    """

    # Not the scrolling keys of ScrollView: ← → home end move through the steps.
    BINDINGS = [
        Binding("up,k", "move_lines(-1)", "up", show=False),
        Binding("down,j", "move_lines(1)", "down", show=False),
        Binding("h", "move_cells(-1)", "left", show=False),
        Binding("l", "move_cells(1)", "right", show=False),
        Binding("pageup", "move_lines(-5)", show=False),
        Binding("pagedown", "move_lines(5)", show=False),
    ]

    vm: reactive[BlockMapVM | None] = reactive(None, always_update=True)
    zoom: reactive[str | None] = reactive(None)  # None: automatic
    highlight: reactive[int | None] = reactive(None)  # the selected request's ref
    selected: reactive[int | None] = reactive(None)  # the selected block

    class Selected(Message):
        """The user picked a block."""

        def __init__(self, block: int) -> None:
            super().__init__()
            self.block = block

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._lines: dict[int, Strip] = {}  # rendered lines, until something changes
        self._hl_cells: frozenset[int] = frozenset()  # highlighted blocks

    # -- layout ----------------------------------------------------------------------------

    @property
    def label_width(self) -> int:
        """Each line starts with its first block's id, right-aligned, and a space."""
        n = self.vm.num_blocks if self.vm is not None else 1
        return len(str(n - 1)) + 1

    @property
    def geometry(self) -> Geometry:
        n = self.vm.num_blocks if self.vm is not None else 1
        region = self.scrollable_content_region
        return geometry(n, region.width - self.label_width, region.height, self.zoom)

    def _relayout(self) -> None:
        self._lines.clear()
        vm = self.vm
        if vm is not None and self.highlight is not None:
            ref = self.highlight
            owners = vm.owners
            self._hl_cells = frozenset(
                b for b, o in enumerate(vm.owner)
                if o == ref or (o >= 0 and b in owners and ref in owners[b]))
        else:
            self._hl_cells = frozenset()
        g = self.geometry
        self.virtual_size = Size(g.cols + self.label_width, g.lines)
        self.refresh()

    def watch_vm(self) -> None:
        self._relayout()

    def watch_zoom(self) -> None:
        self._relayout()
        self._scroll_to_selected()

    def watch_highlight(self) -> None:
        self._relayout()

    def watch_selected(self) -> None:
        self._lines.clear()
        self.refresh()

    def on_resize(self) -> None:
        self._relayout()

    @property
    def title(self) -> str:
        g = self.geometry
        return ZOOM_TITLES[g.zoom].format(g.per_cell)

    # -- input -----------------------------------------------------------------------------

    def on_click(self, event: events.Click) -> None:
        at = event.get_content_offset(self)
        if at is None or self.vm is None:
            return
        g = self.geometry
        x = at.x - self.label_width
        if not 0 <= x < g.cols:
            return
        block = (self.scroll_offset.y + at.y) * g.per_line + x * g.per_cell
        if block < self.vm.num_blocks:
            self.post_message(self.Selected(block))

    def action_move_lines(self, lines: int) -> None:
        self._move(lines * self.geometry.per_line)

    def action_move_cells(self, cells: int) -> None:
        self._move(cells * self.geometry.per_cell if self.geometry.zoom == "fit" else cells)

    def _move(self, delta: int) -> None:
        if self.vm is None:
            return
        start = self.selected if self.selected is not None else 0
        block = min(max(start + delta, 0), self.vm.num_blocks - 1)
        self.post_message(self.Selected(block))

    def _scroll_to_selected(self) -> None:
        if self.selected is not None:
            x, y = self.geometry.cell_of(self.selected)
            self.scroll_to_region(Region(x + self.label_width, y, 1, 1), animate=False)

    # -- drawing -------------------------------------------------------------------------------

    def render_line(self, y: int) -> Strip:
        line = self.scroll_offset.y + y
        strip = self._lines.get(line)
        if strip is None:
            strip = self._draw(line)
            self._lines[line] = strip
        return strip

    def _draw(self, line: int) -> Strip:
        vm = self.vm
        width = self.size.width
        g = self.geometry
        if vm is None or line >= g.lines:
            return Strip.blank(width)
        lo = line * g.per_line
        hi = min(lo + g.per_line, vm.num_blocks)
        if g.zoom == "block":
            cells = [self._block_cell(vm, b) for b in range(lo, hi)]
        elif g.zoom == "half":
            cells = [self._half_cell(vm, b) for b in range(lo, hi, 2)]
        else:
            cells = [self._fit_cell(vm, b, min(b + g.per_cell, hi))
                     for b in range(lo, hi, g.per_cell)]
        label = Segment(f"{lo:>{self.label_width - 1}} ", _LABEL)
        return Strip([label, *_merge(cells)]).extend_cell_length(width).crop(0, width)

    def _colour(self, vm: BlockMapVM, b: int) -> str:
        cls = vm.cls[b]
        if cls == USED:
            colour = palette.owner(vm.owner[b])
        else:
            colour = _CLASS_COLOURS[cls]
        if self._hl_cells and b not in self._hl_cells and cls in (USED, SHARED):
            colour = palette.dim(colour)
        return colour

    def _block_cell(self, vm: BlockMapVM, b: int) -> tuple[str, Style]:
        cls = vm.cls[b]
        hl = b in self._hl_cells
        return _GLYPHS[cls], palette.style(self._colour(vm, b), reverse=b == self.selected,
                                           bold=hl, underline=hl)

    def _half_cell(self, vm: BlockMapVM, b: int) -> tuple[str, Style]:
        right = b + 1
        bg = self._colour(vm, right) if right < vm.num_blocks else None
        chosen = self.selected in (b, right)
        return "▌", palette.style(self._colour(vm, b), bg, reverse=chosen)

    def _fit_cell(self, vm: BlockMapVM, lo: int, hi: int) -> tuple[str, Style]:
        classes = vm.cls[lo:hi]
        used = sum(1 for c in classes if c in (USED, SHARED))
        n = hi - lo
        chosen = self.selected is not None and lo <= self.selected < hi
        hl = bool(self._hl_cells) and any(b in self._hl_cells for b in range(lo, hi))
        if used == 0:
            cached = classes.count(CACHED)
            colour = palette.CACHED if cached * 2 >= n else palette.FREE
            return ("▒" if cached * 2 >= n else "·"), palette.style(colour, reverse=chosen)
        top = Counter(vm.owner[b] if vm.cls[b] == USED else -2 for b in range(lo, hi)
                      if vm.cls[b] in (USED, SHARED)).most_common(1)[0][0]
        colour = palette.SHARED if top == -2 else palette.owner(top)
        if self._hl_cells and not hl:
            colour = palette.dim(colour)
        shade = _SHADES[max(1, round(used / n * (len(_SHADES) - 1)))]
        return shade, palette.style(colour, reverse=chosen, bold=hl, underline=hl)


def _merge(cells: list[tuple[str, Style]]) -> list[Segment]:
    """Runs of cells with one style become one segment (a line has up to hundreds)."""
    out: list[Segment] = []
    text: list[str] = []
    current: Style | None = None
    for char, style in cells:
        if style is not current and text:
            out.append(Segment("".join(text), current))
            text = []
        current = style
        text.append(char)
    if text:
        out.append(Segment("".join(text), current))
    return out
