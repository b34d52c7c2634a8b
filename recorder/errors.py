"""The errors the trace code raises. Readers raise only TraceError, whatever the input."""

from __future__ import annotations

from engine.errors import UserError

# UserError is re-exported for the TUI, which imports nothing of the engine.
__all__ = ["RecordingError", "TraceError", "UserError"]


class TraceError(UserError):
    """A trace that cannot be read: missing, not a trace, too new, or malformed.

    `offset` is the byte offset of the record (or field) at fault, None when the problem
    is the file as a whole (say, it does not exist). `incomplete` marks a file that may
    still become readable: missing, or too short for its header (a writer just starting)."""

    def __init__(
        self, message: str, offset: int | None = None, *, incomplete: bool = False
    ) -> None:
        super().__init__(message, offset)
        self.message = message
        self.offset = offset
        self.incomplete = incomplete
        self.path: str | None = None  # the file, when the caller knows it

    def at(self, path: object) -> TraceError:
        """This error, naming the file it is about."""
        self.path = str(path)
        return self

    def __str__(self) -> str:
        where = "" if self.path is None else f"{self.path}: "
        if self.offset is not None:
            where += f"at byte {self.offset}: "
        return where + self.message


class RecordingError(UserError):
    """A recording that cannot start (the trace file cannot be created, say)."""
