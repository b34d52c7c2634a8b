"""Output text as tokens arrive: incremental detokenization, and stop strings that never
leak into the stream (text that could be the start of a stop string is held back)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    A token may end in the middle of a UTF-8 character: the text of the newest tokens is
    only released once it decodes cleanly, and it is decoded together with a few tokens
    before it so that byte-level merges across token boundaries come out right."""

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # decoding starts here (context for the next delta)
        self._read = 0  # tokens whose text has been released
        self.text = ""  # released so far

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; return the text that became final."""
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""
        delta = now[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        self.text += delta
        return delta

    def finish(self) -> str:
        """The rest of the text once no token will come: what the whole output decodes to,
        less what was released (a dangling partial character included)."""
        full = self._decode(self.ids)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta


class StopStrings:
    """Cuts the text at the first stop string, and holds back its last characters (one
    fewer than the longest stop string has, as vLLM does) until more text shows that they
    do not start one, so that a client never sees a partial stop string. With `include`
    (vLLM's include_stop_str_in_output) the text ends after the stop string, not before."""

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self.stops = tuple(s for s in stops if s)
        self.include = include
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""  # everything decoded so far
        self.sent = 0  # characters of `text` released to the client
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, delta: str, final: bool = False) -> str:
        """Add decoded text; return what may be sent now. After a match, nothing more."""
        if self.matched is not None:
            return ""
        start = max(0, len(self.text) - self._hold)
        self.text += delta
        cut = self._find(start)
        if cut is not None:
            if self.include and self.matched is not None:
                cut += len(self.matched)
            out = self.text[self.sent : cut]
            self.text = self.text[:cut]
            self.sent = cut
            return out
        safe = len(self.text) if final else max(self.sent, len(self.text) - self._hold)
        out = self.text[self.sent : safe]
        self.sent = safe
        return out

    def _find(self, start: int) -> int | None:
        best: int | None = None
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best):
                best, self.matched = i, s
        return best
