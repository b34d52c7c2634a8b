"""The byte layout around record bodies: the file preamble and each record's frame.

    file   = preamble, record*
    preamble = MAGIC (8 bytes), major (u16 LE), minor (u16 LE)
    record = body length (u32 LE), type tag (u8), CRC-32 of tag + body (u32 LE), body

A frame is written in one piece after the whole record is encoded, so a crash leaves
whole records followed by at most one cut record."""

from __future__ import annotations

import struct
import zlib

from recorder.codec import END_BODY_SIZE, MAX_RECORD_BYTES
from recorder.schema import FORMAT_MAJOR, FORMAT_MINOR

MAGIC = b"\x89STRACE\n"  # \x89: not text; \n: catches newline translation
PREAMBLE = struct.Struct("<8sHH")
PREAMBLE_SIZE = PREAMBLE.size
FRAME = struct.Struct("<IBI")
FRAME_SIZE = FRAME.size
END_RECORD_SIZE = FRAME_SIZE + END_BODY_SIZE


def preamble(major: int = FORMAT_MAJOR, minor: int = FORMAT_MINOR) -> bytes:
    return PREAMBLE.pack(MAGIC, major, minor)


# The CRC-32 of each type tag, where a record's checksum starts.
_TAG_CRC = tuple(zlib.crc32(bytes((tag,))) for tag in range(256))


def checksum(rtype: int, body: bytes | memoryview) -> int:
    return zlib.crc32(body, _TAG_CRC[rtype])


def frame_header(rtype: int, body: bytes) -> bytes:
    """The 9 bytes that go before `body` in its record."""
    if len(body) > MAX_RECORD_BYTES:
        raise ValueError(f"record of {len(body)} bytes exceeds {MAX_RECORD_BYTES}")
    return FRAME.pack(len(body), rtype, checksum(rtype, body))


def frame(rtype: int, body: bytes) -> bytes:
    """One whole record: frame header and body."""
    return frame_header(rtype, body) + body
