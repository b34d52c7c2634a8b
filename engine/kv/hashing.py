"""Chained SHA-256 block hashes: a full block's hash covers its tokens and, through its
parent's hash, every token before it. Equal hashes mean equal prefixes, so a block can be
shared by any request whose prompt starts the same way."""

from __future__ import annotations

import struct
from hashlib import sha256
from typing import TYPE_CHECKING

from engine.records import HASH_BYTES

if TYPE_CHECKING:
    from engine.request import Request

# The parent of a request's first block. Fixed, so that hashes (and traces) are the same
# in every process and on every machine.
ROOT_HASH = sha256(b"schedtop block hash v1").digest()


def hash_block(parent: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Hash of one full block: SHA-256 over the parent's hash and the little-endian uint64 ids."""
    payload = struct.pack(f"<{len(token_ids)}Q", *token_ids)
    return sha256(parent + payload).digest()


class BlockHasher:
    """Extends `request.block_hashes` whenever a request's tokens fill another block."""

    __slots__ = ("block_size", "_pack")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # hash_block's packing with the format compiled once: building the format string
        # and parsing it cost a third of a block's hash (a decode step hashes one block per
        # block_size running requests). The bytes are the same.
        self._pack = struct.Struct(f"<{block_size}Q").pack

    def __call__(self, request: Request) -> None:
        hashes = request.block_hashes
        short = request.short_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        pack = self._pack
        start = len(hashes) * bs
        parent = hashes[-1] if hashes else ROOT_HASH
        # A run of full blocks (a prompt's) in one tight loop, each parent the hash just
        # made. (Copying a fresh SHA-256 instead of calling sha256() took more
        # instructions here, not fewer.)
        while start + bs <= len(tokens):
            parent = sha256(parent + pack(*tokens[start : start + bs])).digest()
            hashes.append(parent)
            short.append(parent[:HASH_BYTES])
            start += bs
        # Nothing to hash before the next block is full: the request skips the call until then.
        request.hash_due = start + bs
