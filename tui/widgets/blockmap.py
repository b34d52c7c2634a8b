"""The KV block map: every block of the pool, coloured by the request that holds it.

Three zooms: one block per cell (each block's class told by its glyph), two blocks per
cell (half blocks: the left one in the foreground, the right one in the background), and
an aggregate that fits the whole pool in the pane (each cell summarises a run of blocks:
its shade says how full the run is, its colour who holds most of it). Drawn line by line,
so only the visible lines cost anything at 4096 blocks or more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

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
from tui.widgets.lines import line_keys, set_virtual_size

ZOOMS = ("wide", "block", "half", "fit")
ZOOM_TITLES = {
    "wide": "1 block per 2 cells",
    "block": "1 block per cell",
    "half": "2 blocks per cell",
    "fit": "aggregate: {} blocks per cell",
}
_GLYPHS = {NULL: "╳", FREE: "·", CACHED: "▒", USED: "█", SHARED: "▓"}
_SHADES = " ░▒▓█"
CACHED_RUN = "◦"  # the aggregate zoom: a run mostly cached-free (▒ is a shade there)
_LABEL = palette.style("#5c6370")
_HALF_FREE = "#2f343f"  # a free block where it has no glyph: close to the background
_CLASS_COLOURS = {
    NULL: palette.NULL,
    FREE: palette.FREE,
    CACHED: palette.CACHED,
    SHARED: palette.SHARED,
}


@dataclass(frozen=True, slots=True)
class Geometry:
    """How the pool is laid out in the pane."""

    zoom: str  # wide, block, half or fit
    cols: int  # cells per line (wide: pairs of cells)
    per_cell: int  # blocks per cell
    lines: int  # lines the whole pool takes
    cell_w: int = 1  # terminal columns per cell (2 when wide)

    @property
    def per_line(self) -> int:
        return self.cols * self.per_cell

    def cell_of(self, block: int) -> tuple[int, int]:
        """(x, y) of the cell that shows `block`."""
        y, rest = divmod(block, self.per_line)
        return rest // self.per_cell * self.cell_w, y


def geometry(num_blocks: int, cols: int, rows: int, zoom: str | None) -> Geometry:
    """The layout for `zoom` in `cols` x `rows` cells (None: the largest zoom at which the
    whole pool fits)."""
    cols, rows = max(2, cols), max(1, rows)
    if zoom is None:
        zoom = (
            "wide"
            if num_blocks <= cols // 2 * rows
            else "block"
            if num_blocks <= cols * rows
            else "half"
            if num_blocks <= 2 * cols * rows
            else "fit"
        )
    if zoom == "wide":
        return Geometry(zoom, cols // 2, 1, -(-num_blocks // (cols // 2)), 2)
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
        *line_keys("move_lines", page=5),
        Binding("h", "move_cells(-1)", "left", show=False),
        Binding("l", "move_cells(1)", "right", show=False),
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

    class Laid(Message):
        """The map's layout changed (a new size, zoom or pool): what its legend says
        follows it, since the first frame may come before the map has a size."""

        def __init__(self, geometry: Geometry) -> None:
            super().__init__()
            self.geometry = geometry

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        # Rendered lines: (look, the line's classes, its owners, strip). A new step reuses
        # every line whose blocks did not change; anything else that changes how blocks
        # look (selection, zoom, size) bumps `_look`.
        self._lines: dict[int, tuple[int, bytes, bytes, Strip]] = {}
        self._look = 0
        self._hl_cells: frozenset[int] = frozenset()  # highlighted blocks
        self._geometry: tuple[tuple[int, int, int, str | None], Geometry] | None = None
        self._pass = (0, geometry(1, 2, 1, None))  # width and layout of the pass rendering
        self._top = 0  # and its scroll offset
        self._pass_key: tuple[int, Geometry] | None = None
        self._told: Geometry | None = None  # the layout the last Laid message carried

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
        key = (n, region.width, region.height, self.zoom)
        if self._geometry is None or self._geometry[0] != key:  # asked for once a line
            self._geometry = (
                key,
                geometry(n, region.width - self.label_width, region.height, self.zoom),
            )
        return self._geometry[1]

    def _relayout(self, look: bool = True) -> None:
        vm = self.vm
        hl = (
            frozenset(vm.tables.get(self.highlight, ()))
            if vm is not None and self.highlight is not None
            else frozenset()
        )
        if look or hl != self._hl_cells:
            self._look += 1
        self._hl_cells = hl
        g = self.geometry
        set_virtual_size(self, Size(g.cols * g.cell_w + self.label_width, g.lines))
        if g != self._told:
            self._told = g
            self.post_message(self.Laid(g))
        self.refresh()

    def watch_vm(self) -> None:
        self._relayout(look=False)

    def watch_zoom(self) -> None:
        self._relayout()
        self._scroll_to_selected()

    def watch_highlight(self) -> None:
        self._relayout()

    def watch_selected(self) -> None:
        self._look += 1
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
        x = (at.x - self.label_width) // g.cell_w
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

    def render_lines(self, crop: Region) -> list[Strip]:
        # Sizes once per pass (they are computed afresh each time they are read).
        width, g = self._pass = (self.size.width, self.geometry)
        self._top = self.scroll_offset.y
        key = (width, g)
        if key != self._pass_key:
            self._pass_key = key
            self._look += 1
        return super().render_lines(crop)

    def render_line(self, y: int) -> Strip:
        line = self._top + y
        vm = self.vm
        if vm is None:
            return Strip.blank(self._pass[0])
        per_line = self._pass[1].per_line
        lo = line * per_line
        cls = vm.cls[lo : lo + per_line]
        owners = cast(memoryview, vm.owner)[lo : lo + per_line].tobytes()
        cached = self._lines.get(line)
        if (
            cached is not None
            and cached[0] == self._look
            and cached[1] == cls
            and cached[2] == owners
        ):
            return cached[3]
        strip = self._draw(line)
        self._lines[line] = (self._look, cls, owners, strip)
        return strip

    def _draw(self, line: int) -> Strip:
        vm = self.vm
        width, g = self._pass
        if vm is None or line >= g.lines:
            return Strip.blank(width)
        lo = line * g.per_line
        hi = min(lo + g.per_line, vm.num_blocks)
        if g.zoom == "wide":
            cells = [c for b in range(lo, hi) for c in self._wide_cell(vm, b)]
        elif g.zoom == "block":
            cells = [self._block_cell(vm, b) for b in range(lo, hi)]
        elif g.zoom == "half":
            cells = [self._half_cell(vm, b) for b in range(lo, hi, 2)]
        else:
            cells = [
                self._fit_cell(vm, b, min(b + g.per_cell, hi)) for b in range(lo, hi, g.per_cell)
            ]
        label = f"{lo:>{self.label_width - 1}} "
        segments = [Segment(label, _LABEL), *_merge(cells)]
        used = len(label) + len(cells)  # every glyph is one cell wide
        if used < width:
            segments.append(Segment(" " * (width - used)))
        return (
            Strip(segments, max(width, used)).crop(0, width)
            if used > width
            else Strip(segments, width)
        )

    def _colour(self, vm: BlockMapVM, b: int, cls: int) -> str:
        colour = palette.owner(vm.owner[b]) if cls == USED else _CLASS_COLOURS[cls]
        if self._hl_cells and cls >= USED and b not in self._hl_cells:
            colour = palette.dim(colour)
        return colour

    def _block_cell(self, vm: BlockMapVM, b: int) -> tuple[str, Style]:
        cls = vm.cls[b]
        hl = b in self._hl_cells
        return _GLYPHS[cls], palette.style(
            self._colour(vm, b, cls), reverse=b == self.selected, bold=hl, underline=hl
        )

    def _wide_cell(self, vm: BlockMapVM, b: int) -> tuple[tuple[str, Style], ...]:
        """A block in two cells (a small pool fills the pane and is easier to click)."""
        cell = self._block_cell(vm, b)
        return cell, cell

    def _half_cell(self, vm: BlockMapVM, b: int) -> tuple[str, Style]:
        """Two blocks in one cell: the left one is the glyph, the right one its background.
        Free blocks are nearly background here (there is no glyph to tell them by); the
        selected block is drawn white."""
        right = b + 1
        left_colour = self._half_colour(vm, b)
        right_colour = self._half_colour(vm, right) if right < vm.num_blocks else None
        if self.selected == right and right_colour is not None:
            return "▐", palette.style("#ffffff", left_colour)
        if self.selected == b:
            left_colour = "#ffffff"
        return "▌", palette.style(left_colour, right_colour)

    def _half_colour(self, vm: BlockMapVM, b: int) -> str:
        cls = vm.cls[b]
        return _HALF_FREE if cls == FREE else self._colour(vm, b, cls)

    def _fit_cell(self, vm: BlockMapVM, lo: int, hi: int) -> tuple[str, Style]:
        """A run of blocks: its shade says how much of it is held (counted exactly), its
        colour who holds its first held block (a run is mostly one table's, or shared)."""
        run = vm.cls[lo:hi]
        n = hi - lo
        held = n - run.count(FREE) - run.count(CACHED) - run.count(NULL)
        chosen = self.selected is not None and lo <= self.selected < hi
        if held == 0:
            cached = run.count(CACHED) * 2 >= n
            # Not ▒: in this zoom that shade means "half held".
            return (CACHED_RUN if cached else "·"), palette.style(
                palette.CACHED if cached else palette.FREE, reverse=chosen
            )
        first = run.find(USED)
        colour = palette.SHARED if first < 0 else palette.owner(vm.owner[lo + first])
        hl_cells = self._hl_cells
        hl = bool(hl_cells) and not hl_cells.isdisjoint(range(lo, hi))
        if hl_cells and not hl:
            colour = palette.dim(colour)
        shade = _SHADES[max(1, round(held / n * (len(_SHADES) - 1)))]
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
