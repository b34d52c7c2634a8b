"""The encoding machinery: dataclasses to msgpack bodies and back, validating everything
that comes in. `recorder.codec` declares the format's tables with it.

Encoding rules (docs/trace-format.md has the tables):
- a record body is a msgpack map from small integer keys to values; fields equal to their
  default are left out, and readers ignore keys they do not know;
- an item (one KV event, one arrival) is a msgpack array of its fields in order; trailing
  fields equal to their default are left out, and readers ignore extra trailing elements;
- a list of items is a bin holding the items' msgpack encodings back to back, so that no
  msgpack array is ever longer than a record type's field count;
- a list of non-negative integers is a bin: one width byte (1, 2, 4 or 8), then the values
  little-endian at that width;
- a list of hashes is a bin: one length byte, then the hashes back to back.

Decoding never trusts its input: every container and string is size-limited before it is
built, every value is type-checked, and every failure is a TraceError naming the offset.
"""

from __future__ import annotations

import dataclasses
import struct
import sys
import threading
from array import array
from collections.abc import Callable, Sequence
from operator import attrgetter, itemgetter
from typing import Any, Generic, TypeVar

import msgpack

from engine.records import HASH_BYTES

T = TypeVar("T")

MAX_RECORD_BYTES = 64 << 20  # a frame declaring a longer body is corrupt
MAX_STR_LEN = 1 << 20  # request ids, messages, model descriptions

# Small arrays and maps only: msgpack allocates a container's declared size before reading
# its elements, so these bound the memory a hostile body can claim (times the unpacker's
# nesting limit of 1024) to a few MiB.
_LIMITS: dict[str, Any] = dict(
    raw=False,
    use_list=False,
    strict_map_key=False,
    max_str_len=MAX_STR_LEN,
    max_bin_len=MAX_RECORD_BYTES,
    max_array_len=64,
    max_map_len=256,
    max_ext_len=0,
)
_DECODE_ERRORS = (ValueError, TypeError, OverflowError, msgpack.UnpackException)
_packer = msgpack.Packer(use_bin_type=True, autoreset=True)
_BIG_ENDIAN = sys.byteorder == "big"
_TYPECODES = {w: next(tc for tc in "BHILQ" if array(tc).itemsize == w) for w in (1, 2, 4, 8)}
_STRUCT_CODES = {1: "B", 2: "H", 4: "I", 8: "Q"}
_WIDTH_BYTE = {w: bytes((w,)) for w in (1, 2, 4, 8)}
_PACKERS: dict[tuple[int, int], Callable[..., bytes]] = {}
_UNPACKERS: dict[tuple[int, int], Callable[..., tuple[int, ...]]] = {}


class Bad(Exception):
    """A decoding failure deep inside a body; `path` (the field names) is added on the way
    up, so the message names the field at fault."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
        self.path: list[str] = []

    def message(self) -> str:
        where = ".".join(reversed(self.path)).replace(".[", "[")
        return f"{where}: {self.what}" if where else self.what


def kind_of(v: object) -> str:
    return "nil" if v is None else type(v).__name__


# -- scalar codecs ----------------------------------------------------------------------------


class Codec(Generic[T]):
    """Turns one field's value into msgpack-ready data and back (with validation)."""

    __slots__ = ()

    def enc(self, v: T) -> Any:
        return v

    def dec(self, v: Any) -> T:
        raise NotImplementedError


class _UInt(Codec[int]):
    __slots__ = ()

    def dec(self, v: Any) -> int:
        if type(v) is int and v >= 0:
            return v
        raise Bad(
            f"expected an unsigned integer, got {v!r}"
            if type(v) is int
            else f"expected an unsigned integer, got {kind_of(v)}"
        )


class _Int(Codec[int]):
    __slots__ = ()

    def dec(self, v: Any) -> int:
        if type(v) is int:
            return v
        raise Bad(f"expected an integer, got {kind_of(v)}")


class _Float(Codec[float]):
    __slots__ = ()

    def dec(self, v: Any) -> float:
        if type(v) is float:
            return v
        if type(v) is int:
            return float(v)
        raise Bad(f"expected a number, got {kind_of(v)}")


class _Bool(Codec[bool]):
    __slots__ = ()

    def dec(self, v: Any) -> bool:
        if type(v) is bool:
            return v
        raise Bad(f"expected a boolean, got {kind_of(v)}")


class _Str(Codec[str]):
    __slots__ = ()

    def dec(self, v: Any) -> str:
        if type(v) is str:
            return v
        raise Bad(f"expected a string, got {kind_of(v)}")


class Opt(Codec[T | None]):
    """nil or the inner codec's value."""

    __slots__ = ("inner",)

    def __init__(self, inner: Codec[T]) -> None:
        self.inner = inner

    def enc(self, v: T | None) -> Any:
        return None if v is None else self.inner.enc(v)

    def dec(self, v: Any) -> T | None:
        return None if v is None else self.inner.dec(v)


UINT, INT, FLOAT, BOOL, STR = _UInt(), _Int(), _Float(), _Bool(), _Str()


# -- packed arrays ------------------------------------------------------------------------------


def pack_ints(values: Sequence[int]) -> bytes:
    """Non-negative ints as one width byte plus little-endian values; b"" when empty.

    Short lists get the narrowest width; long ones (tokens, free queues) try 2 bytes
    first, because finding the maximum costs as much as packing."""
    n = len(values)
    if not n:
        return b""
    if not _spend(n):
        raise ValueError(f"the record holds more than {MAX_RECORD_INTS} integers")
    if n <= 64:
        top = max(values)
        widths: tuple[int, ...] = (
            1 if top < 0x100 else 2 if top < 0x10000 else 4 if top < 1 << 32 else 8,
        )
    else:
        widths = (2, 4, 8)
    for width in widths:
        try:
            return _WIDTH_BYTE[width] + _packer_for(n, width)(*values)
        except struct.error:
            continue
    raise ValueError(f"cannot pack {min(values)}..{max(values)} as unsigned 64-bit integers")


def _packer_for(n: int, width: int) -> Callable[..., bytes]:
    pack = _PACKERS.get((n, width))
    if pack is None:
        pack = struct.Struct(f"<{n}{_STRUCT_CODES[width]}").pack
        if n <= 1024:  # the common lengths; longer ones are rare and would fill the cache
            _PACKERS[(n, width)] = pack
    return pack


MAX_RECORD_INTS = 1 << 24  # integers in one record's arrays, all together (writers too)


class _Budget(threading.local):
    # Integers the record being coded may still hold; None: no record begun. A class
    # default, so that reading it on a thread that never began one (the recorder's
    # encoding thread, which writes steady steps with encode_steady) raises nothing:
    # a getattr that fails costs a microsecond, and pack_ints reads it per column.
    left: int | None = None


_budget = _Budget()


def begin_record() -> None:
    """Count the integers of the record about to be encoded or decoded (on this thread)
    against MAX_RECORD_INTS, until end_record(): a 64 MiB record of 2-byte ids would
    otherwise decode to 1.6 GB of Python ints. Decoding checks before it builds any."""
    _budget.left = MAX_RECORD_INTS


def end_record() -> None:
    _budget.left = None


def _spend(n: int) -> bool:
    """False when the record in progress would hold more than MAX_RECORD_INTS."""
    left = _budget.left
    if left is None:
        return True
    _budget.left = left - n
    return left >= n


def unpack_ints(data: bytes) -> tuple[int, ...]:
    if not data:
        return ()
    width = data[0]
    typecode = _TYPECODES.get(width)
    if typecode is None:
        raise Bad(f"integer array width {width}: must be 1, 2, 4 or 8")
    if (len(data) - 1) % width:
        raise Bad(f"integer array of {len(data) - 1} bytes is not a multiple of width {width}")
    if not _spend((len(data) - 1) // width):
        raise Bad(f"the record holds more than {MAX_RECORD_INTS} integers")
    n = (len(data) - 1) // width
    if n <= 1024:
        # One cached C-level unpacker per length and width, reading the values straight
        # into a tuple: no copy of the bytes, no array, no byte swapping (a step's KV
        # columns are a few of these each, thousands of steps a second in a live view).
        unpack = _UNPACKERS.get((n, width))
        if unpack is None:
            unpack = _UNPACKERS[(n, width)] = struct.Struct(
                f"<{n}{_STRUCT_CODES[width]}"
            ).unpack_from
        return unpack(data, 1)
    if width == 1:
        return tuple(data[1:])  # bytes are read as their values: no array needed
    values = array(typecode)
    values.frombytes(memoryview(data)[1:])
    if _BIG_ENDIAN:
        values.byteswap()
    return tuple(values)


class _Ints(Codec[tuple[int, ...]]):
    __slots__ = ()

    def enc(self, v: tuple[int, ...]) -> bytes:
        return pack_ints(v)

    def dec(self, v: Any) -> tuple[int, ...]:
        if type(v) is not bytes:
            raise Bad(f"expected an integer array (bin), got {kind_of(v)}")
        return unpack_ints(v)


class _Offsets(Codec[tuple[int, ...]]):
    """Ascending offsets, stored as the first one and then the gaps."""

    __slots__ = ()

    def enc(self, v: tuple[int, ...]) -> bytes:
        return pack_ints([b - a for a, b in zip((0, *v), v)])

    def dec(self, v: Any) -> tuple[int, ...]:
        gaps = INTS.dec(v)
        out: list[int] = []
        total = 0
        for gap in gaps:
            total += gap
            out.append(total)
        return tuple(out)


class _Hashes(Codec[tuple[bytes, ...]]):
    __slots__ = ()

    def enc(self, v: tuple[bytes, ...]) -> bytes:
        if not v:
            return b""
        try:
            joined = b"".join(v)
        except TypeError:  # hashes computed on first use (recorder.vllm): bytes() gives each
            v = tuple(map(bytes, v))
            joined = b"".join(v)
        size = len(v[0])
        if not 0 < size < 256 or set(map(len, v)) != {size}:
            raise ValueError("hashes must all have the same length, 1 to 255 bytes")
        return bytes((size,)) + joined

    def dec(self, v: Any) -> tuple[bytes, ...]:
        if type(v) is not bytes:
            raise Bad(f"expected a hash list (bin), got {kind_of(v)}")
        if not v:
            return ()
        size = v[0]
        if size == 0 or (len(v) - 1) % size:
            raise Bad(f"hash list of {len(v) - 1} bytes does not divide into {size}-byte hashes")
        # One C-level pass: the hashes are fixed-size fields of a struct. Longer hashes
        # (traces before 1.3 kept SHA-256's 32 bytes) are read as their first HASH_BYTES,
        # so that hashes from any trace compare alike.
        keep = min(size, HASH_BYTES)
        form = f"{keep}s{size - keep}x" if size > keep else f"{size}s"
        n = (len(v) - 1) // size
        if n <= 64 and size <= 32:  # (at most 2048 unpackers, whatever a trace holds)
            # A step's few cached blocks: one cached unpacker straight into a tuple (the
            # iterator and the map cost more than the hashes, thousands of steps a second)
            unpack = _HASH_UNPACKERS.get((n, size))
            if unpack is None:
                unpack = _HASH_UNPACKERS[(n, size)] = struct.Struct(form * n).unpack_from
            return unpack(v, 1)
        return tuple(map(_FIRST, struct.iter_unpack(form, memoryview(v)[1:])))


_HASH_UNPACKERS: dict[tuple[int, int], Callable[..., tuple[bytes, ...]]] = {}


_FIRST = itemgetter(0)
INTS, OFFSETS, HASHES = _Ints(), _Offsets(), _Hashes()


class _Config(Codec[dict[str, Any]]):
    """A map from names to scalars (the engine config)."""

    __slots__ = ()

    def dec(self, v: Any) -> dict[str, Any]:
        if type(v) is not dict:
            raise Bad(f"expected a map, got {kind_of(v)}")
        for key, value in v.items():
            if type(key) is not str:
                raise Bad(f"config key {key!r} is not a string")
            if value is not None and type(value) not in (str, int, float, bool):
                raise Bad(f"config {key}: expected a scalar, got {kind_of(value)}")
        return dict(v)


CONFIG = _Config()


# -- structures ---------------------------------------------------------------------------------

_MISSING: Any = object()


def _defaults(cls: type) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
    return out


class Struct(Codec[T]):
    """A dataclass as a msgpack array of its fields in declaration order."""

    __slots__ = ("cls", "names", "codecs", "defaults", "required", "_values", "_custom")

    def __init__(
        self,
        cls: Callable[..., T],
        fields: Sequence[tuple[str, Codec[Any]]],
        required: int | None = None,
    ) -> None:
        declared = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        assert declared == [name for name, _ in fields], f"{cls}: fields out of order"
        assert len(fields) > 1, "attrgetter of one name would not return a tuple"
        self.cls = cls
        self.names = tuple(name for name, _ in fields)
        self.codecs = tuple(codec for _, codec in fields)
        defaults = _defaults(cls)  # type: ignore[arg-type]
        self.defaults = tuple(defaults.get(name, _MISSING) for name in self.names)
        # `required`: leading fields always written, defaults or not (the format's rule
        # where the class has defaults the format does not).
        self.required = (
            sum(1 for d in self.defaults if d is _MISSING) if required is None else required
        )
        self._values = attrgetter(*self.names)
        # Scalars encode as themselves: only the other fields' codecs are called (a
        # snapshot has a structure per request, most of whose fields are scalars).
        self._custom = tuple(
            (i, c.enc) for i, c in enumerate(self.codecs) if type(c).enc is not Codec.enc
        )

    def enc(self, v: T) -> list[Any]:
        values = self._values(v)
        end = len(values)
        while end > self.required and values[end - 1] == self.defaults[end - 1]:
            end -= 1
        out = list(values[:end])
        for i, enc in self._custom:
            if i < end:
                out[i] = enc(out[i])
        return out

    def dec(self, v: Any) -> T:
        if type(v) is not tuple:
            raise Bad(f"expected an array, got {kind_of(v)}")
        if len(v) < self.required:
            raise Bad(f"{len(v)} fields, at least {self.required} needed")
        # One comprehension, no per-field bookkeeping: a step's KV events and items are
        # decoded by the thousand a second when a live view follows an engine. A field
        # that does not decode is found again by the loop below, which names it.
        try:
            args = [codec.dec(x) for codec, x in zip(self.codecs, v)]
        except Bad:
            return self._dec_naming(v)
        if len(args) < len(self.codecs):
            args.extend(self.defaults[len(args) :])
        try:
            return self.cls(*args)
        except ValueError as e:  # the class's own validation (sampling parameters)
            raise Bad(str(e)) from None

    def _dec_naming(self, v: tuple[Any, ...]) -> T:
        """dec(), field by field: the error names the field that is wrong."""
        args = []
        for i, codec in enumerate(self.codecs):
            try:
                args.append(codec.dec(v[i]) if i < len(v) else self.defaults[i])
            except Bad as e:
                e.path.append(self.names[i])
                raise
        try:
            return self.cls(*args)
        except ValueError as e:  # the class's own validation (sampling parameters)
            raise Bad(str(e)) from None


class Items(Codec[tuple[T, ...]]):
    """A list of structures as a bin of their msgpack encodings back to back."""

    __slots__ = ("item",)

    def __init__(self, item: Struct[T]) -> None:
        self.item = item

    def enc(self, v: tuple[T, ...]) -> bytes:
        pack, enc = _packer.pack, self.item.enc
        return b"".join([pack(enc(x)) for x in v])

    def dec(self, v: Any) -> tuple[T, ...]:
        if type(v) is not bytes:
            raise Bad(f"expected an item list (bin), got {kind_of(v)}")
        if not v:
            return ()
        # Most lists hold one item (a step's one arrival, admission or finish): one
        # unpackb is a tenth of the cost of setting up an Unpacker, which is a good part
        # of decoding a step. Several items, or malformed ones, raise: the general path
        # below reads them and names what is wrong.
        try:
            obj = msgpack.unpackb(v, **_LIMITS)
        except Exception:  # noqa: BLE001 - ExtraData or a decoding error: see below
            return self._stream(v)
        try:
            return (self.item.dec(obj),)
        except Bad as e:
            e.path.append("[0]")
            raise

    def _stream(self, v: bytes) -> tuple[T, ...]:
        unpacker = msgpack.Unpacker(max_buffer_size=len(v), **_LIMITS)
        unpacker.feed(v)
        out: list[T] = []
        dec = self.item.dec
        end = 0  # where the last whole item ends
        try:
            for obj in unpacker:
                out.append(dec(obj))
                end = unpacker.tell()
        except Bad as e:
            e.path.append(f"[{len(out)}]")
            raise
        except _DECODE_ERRORS as e:
            raise Bad(f"item {len(out)}: malformed msgpack ({_why(e)})") from None
        if end != len(v):
            raise Bad(f"item {len(out)} is cut short")
        return tuple(out)


class Body(Generic[T]):
    """A record as a msgpack map from integer keys to fields; unknown keys are skipped."""

    __slots__ = (
        "cls",
        "fields",
        "defaults",
        "_values",
        "_plan",
        "_by_key",
        "_required",
    )

    def __init__(
        self, cls: Callable[..., T], fields: Sequence[tuple[int, str, Codec[Any]]]
    ) -> None:
        declared = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        assert declared == {name for _, name, _ in fields}, f"{cls}: fields do not match"
        self.cls = cls
        self.fields = tuple(fields)
        defaults = _defaults(cls)  # type: ignore[arg-type]
        self.defaults = tuple(defaults.get(name, _MISSING) for _, name, _ in fields)
        self._values = attrgetter(*(name for _, name, _ in fields))  # all fields, one call
        self._by_key = {key: (name, codec) for key, name, codec in fields}
        self._required = frozenset(
            name for (_, name, _), default in zip(fields, self.defaults) if default is _MISSING
        )
        self._plan = tuple(
            (key, codec, default) for (key, _, codec), default in zip(fields, self.defaults)
        )

    def encode(self, record: T) -> bytes:
        return _pack_map(self._plan, self._values(record))

    def encoder_of(self, names: Sequence[str]) -> Callable[..., bytes]:
        """An encoder of records whose other fields all hold their defaults, from the
        values of `names` (in field order): the bytes `encode` makes of such a record,
        without building it or looking at the other fields."""
        index = {name: i for i, (_, name, _) in enumerate(self.fields)}
        picked = [index[name] for name in names]
        if picked != sorted(picked):
            raise ValueError("encoder_of: names out of field order")
        plan = tuple(self._plan[i] for i in picked)

        def encode(*values: Any) -> bytes:
            return _pack_map(plan, values)

        return encode

    def decode(self, body: bytes) -> T:
        return self.decode_map(unpack_body(body))

    def decode_map(self, obj: Any) -> T:
        """decode() of the body's msgpack, unpacked already."""
        if type(obj) is not dict:
            raise Bad(f"expected a map, got {kind_of(obj)}")
        kwargs: dict[str, Any] = {}
        by_key = self._by_key
        for key, value in obj.items():  # only what is there: most fields are defaults
            spec = by_key.get(key) if type(key) is int else None
            if spec is None:
                continue  # a field from a newer minor version
            name, codec = spec
            try:
                kwargs[name] = codec.dec(value)
            except Bad as e:
                e.path.append(name)
                raise
        if not self._required.issubset(kwargs):
            key, name = next(
                (k, n) for k, n, _ in self.fields if n in self._required and n not in kwargs
            )
            raise Bad(f"required field {name} (key {key}) is missing")
        return self.cls(**kwargs)  # the dataclass fills in the defaults


def _pack_map(plan: Sequence[tuple[int, Codec[Any], Any]], values: Sequence[Any]) -> bytes:
    """A body: the map from key to encoded value of the fields that differ from their
    defaults (`is not` first: most defaults are shared singletons: (), None, small ints)."""
    out = {
        key: codec.enc(value)
        for (key, codec, default), value in zip(plan, values)
        if value is not default and value != default
    }
    return _packer.pack(out)  # type: ignore[no-any-return]


def unpack_body(body: bytes) -> Any:
    try:
        return msgpack.unpackb(body, **_LIMITS)
    except _DECODE_ERRORS as e:
        raise Bad(f"malformed msgpack ({_why(e)})") from None


def _why(e: BaseException) -> str:
    """An exception's reason; its type when it has no message (msgpack raises some bare)."""
    return str(e) or type(e).__name__
