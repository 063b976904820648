"""The wire format of realrl's streams (docs/design.md §4): msgpack for structure, raw
frames for numeric arrays. Never pickle: a peer that can reach a port must not
be able to run code in the receiver.

A message is a list of frames:

- frame 0: `b"RL"` + a version byte, then msgpack of the structure, in which
  every numpy array is replaced by a msgpack ExtType (code 1) whose data is
  `<frame index: u32><dtype code: u8><ndim: u8><dims: ndim x i64>` (little
  endian);
- frames 1..n: the arrays' bytes, in marker order. For C-contiguous arrays
  these are memoryviews of the arrays themselves (no copy).

`encode(obj) -> frames` / `decode(frames) -> obj` work on that list (e.g. a zmq
multipart message). The streams send the one-buffer form instead,
`dumps(obj) -> bytes` / `loads(buffer) -> obj`: the same frames joined behind
a table of their lengths (see "one-buffer form" below for why);
`dump_into(obj, out)` writes it over a reused buffer.

Decoding builds every array with `np.frombuffer` over its frame (no copy), so
the arrays keep the received buffer alive and may be read-only (take `.copy()`
if you need an owned, writable array).

Supported values: None, bool, int (64-bit), float, str, bytes, list / tuple
(tuples come back as lists), dict with str or int keys, numpy arrays of
bool / int8..64 / uint8..64 / float16/32/64, numpy scalars (sent as Python
scalars) and CPU torch tensors (sent as numpy arrays; bfloat16 as float32).

Decoding trusts nothing: it checks magic and version, the total size, the
frame table, the nesting depth, every array marker (frame index in range and
used exactly once, dtype in the whitelist, ndim, non-negative dims, dims x
itemsize == frame length), that every frame is referenced, and that the
structure holds only the types above. Any violation raises `WireFormatError`
and nothing else; nothing in a message is ever executed.
"""

from __future__ import annotations

import io
import struct
import sys
import threading
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from realrl.base.logging import getLogger

logger = getLogger("wire")

MAGIC = b"RL"
VERSION = 1
_HEADER = MAGIC + bytes([VERSION])

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30  # 1 GiB over all frames
DEFAULT_MAX_DEPTH = 32  # nesting of lists / dicts
MAX_NDIM = 32
MAX_FRAMES = 1 << 16

_ARRAY_EXT = 1  # msgpack ExtType code of an array marker
# Marker layout per ndim: frame index (u32), dtype code (u8), ndim (u8), dims (i64 each).
_MARKERS = [struct.Struct(f"<IBB{n}q") for n in range(MAX_NDIM + 1)]

# The dtype whitelist. Codes are part of the format: append, never renumber.
_DTYPES = [
    np.dtype(np.bool_),
    np.dtype("<i1"),
    np.dtype("<i2"),
    np.dtype("<i4"),
    np.dtype("<i8"),
    np.dtype("<u1"),
    np.dtype("<u2"),
    np.dtype("<u4"),
    np.dtype("<u8"),
    np.dtype("<f2"),
    np.dtype("<f4"),
    np.dtype("<f8"),
]
_DTYPE_CODE = {dt: code for code, dt in enumerate(_DTYPES)}
_ITEMSIZES = [dt.itemsize for dt in _DTYPES]
assert _MARKERS[0].size == 6 and _ARRAY_EXT == 1 and len(_DTYPES) == 12  # literals in decode's hook
_SCALARS = frozenset([type(None), bool, int, float, str, bytes])
_LEAVES = _SCALARS | {np.ndarray}  # what a decoded structure may hold besides lists and dicts
_KEYS = frozenset([str, int])  # (not bool)

if sys.byteorder != "little":  # the format is little-endian; so is every host we run on
    raise ImportError("realrl.base.wire assumes a little-endian host")


class WireFormatError(ValueError):
    """A message that does not decode or validate. The only exception decoding raises."""


# ---- encode ------------------------------------------------------------------


def _as_numpy(obj: Any) -> np.ndarray | None:
    """`obj` as a numpy array if it is a CPU torch tensor, else None."""
    torch = sys.modules.get("torch")  # never import torch just to check
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    if obj.device.type != "cpu":
        raise TypeError(f"wire.encode: move tensors to CPU before sending (got device {obj.device})")
    tensor = obj.detach()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16
        tensor = tensor.float()
    return tensor.resolve_conj().resolve_neg().numpy()


def _checked_array(array: np.ndarray) -> tuple[np.ndarray, int]:
    """`array` as a C-contiguous little-endian array of a whitelisted dtype, and its code."""
    code = _DTYPE_CODE.get(array.dtype)
    if code is None:
        native = array.dtype.newbyteorder("<")
        code = _DTYPE_CODE.get(native)
        if code is None:
            raise TypeError(
                f"wire.encode: unsupported array dtype {array.dtype}; supported: {[str(d) for d in _DTYPES]}"
            )
        array = array.astype(native)
    if array.ndim > MAX_NDIM:
        raise TypeError(f"wire.encode: arrays have at most {MAX_NDIM} dims, got {array.ndim}")
    if not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)  # the only copy encode makes
    return array, code


class _ArrayCollector:
    """The `default` hook of a msgpack Packer: swaps each array for a marker
    and collects the (C-contiguous, whitelisted) array as the next frame."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []

    def hook(self, value: Any) -> Any:
        if type(value) is np.ndarray:
            code = _DTYPE_CODE.get(value.dtype)
            if code is None or not value.flags.c_contiguous or value.ndim > MAX_NDIM:
                value, code = _checked_array(value)
        elif isinstance(value, np.generic):
            if value.dtype not in _DTYPE_CODE and value.dtype.newbyteorder("<") not in _DTYPE_CODE:
                raise TypeError(f"wire.encode: unsupported numpy scalar type {value.dtype}")
            return value.item()
        else:
            array = value if isinstance(value, np.ndarray) else _as_numpy(value)  # subclass (memmap, ...) or tensor
            if array is None or isinstance(array, np.ma.MaskedArray):  # a mask would be lost silently
                raise TypeError(f"wire.encode: cannot send a {type(value).__module__}.{type(value).__qualname__}")
            value, code = _checked_array(array.view(np.ndarray))
        arrays = self.arrays
        arrays.append(value)
        shape = value.shape
        marker = _MARKERS[len(shape)].pack(len(arrays), code, len(shape), *shape)
        # msgpack.ExtType's own __new__ re-checks its arguments in Python, which costs
        # more than the rest of an array's encoding; ours are valid by construction.
        return tuple.__new__(msgpack.ExtType, (_ARRAY_EXT, marker))


_local = threading.local()  # one Packer per thread: building one per message costs more than packing


def _pack(obj: Any) -> tuple[bytes, list[np.ndarray]]:
    """(frame 0, the arrays in frame order)."""
    try:
        packer, collector = _local.packer, _local.collector
    except AttributeError:
        collector = _local.collector = _ArrayCollector()
        packer = _local.packer = msgpack.Packer(default=collector.hook, use_bin_type=True, buf_size=4096)
    collector.arrays = []
    try:
        head = _HEADER + packer.pack(obj)
        return head, collector.arrays
    finally:
        collector.arrays = []  # hold no reference to the caller's arrays


def _byte_view(array: np.ndarray) -> memoryview | bytes:
    return memoryview(array).cast("B") if array.size else b""


def encode(obj: Any) -> list:
    """Frames of `obj`: frame 0 the header + msgpack structure, then one
    buffer per array (memoryviews over the arrays' own memory where possible:
    do not modify those arrays until the frames have been sent)."""
    head, arrays = _pack(obj)
    return [head, *map(_byte_view, arrays)]


# ---- decode ------------------------------------------------------------------


def _validate(value: Any, depth: int, max_depth: int) -> None:
    """Checks the decoded structure holds only supported types and is not too deep. (The types
    of a container's items are checked together first, in C: a trajectory's are all leaves.)"""
    if depth > max_depth:
        raise WireFormatError(f"structure nested deeper than {max_depth}")
    if type(value) is list:
        if not _LEAVES.issuperset(map(type, value)):
            for item in value:
                if type(item) not in _LEAVES:
                    _validate(item, depth + 1, max_depth)
    elif type(value) is dict:
        if not _KEYS.issuperset(map(type, value)):
            key = next(key for key in value if type(key) not in _KEYS)
            raise WireFormatError(f"dict key of type {type(key).__name__}; only str and int keys are allowed")
        if not _LEAVES.issuperset(map(type, value.values())):
            for item in value.values():
                if type(item) not in _LEAVES:
                    _validate(item, depth + 1, max_depth)
    elif type(value) not in _LEAVES:
        raise WireFormatError(f"unsupported value of type {type(value).__name__}")


def _bad_marker(index: int, dtype_code: int, ndim: int, shape: list, n_frames: int, used: list) -> str:
    if ndim != len(shape):
        return f"array marker says ndim {ndim} but carries {len(shape)} dims"
    if not 1 <= index < n_frames:
        return f"array marker points at frame {index}, message has {n_frames} frames"
    if used[index]:
        return f"frame {index} is referenced twice"
    return f"array dtype code {dtype_code} is not in the whitelist"


def _bad_shape(index: int, nbytes: int, shape: list, dtype: np.dtype) -> str:
    if any(dim < 0 for dim in shape):
        return f"negative array dimension in shape {tuple(shape)}"
    count = 1
    for dim in shape:
        count *= dim
    return f"array frame {index} has {nbytes} bytes; shape {tuple(shape)} of {dtype} needs {count * dtype.itemsize}"


def _decode_frames(bases: list, offsets: Sequence[int], lengths: Sequence[int], max_depth: int) -> Any:
    """Decodes the frames `bases[i][offsets[i] : offsets[i] + lengths[i]]` (1-D byte
    memoryviews; sizes already checked). Arrays are built straight over `bases`."""
    head = bases[0][offsets[0] : offsets[0] + lengths[0]]
    if head[:3] != _HEADER:
        if lengths[0] < len(_HEADER) or head[:2] != MAGIC:
            raise WireFormatError("not a realrl wire message (bad magic)")
        raise WireFormatError(f"wire format version {head[2]} is not supported (this side speaks {VERSION})")
    n_frames = len(lengths)
    used = [False] * n_frames
    used[0] = True
    # Locals of this function are cheaper than globals inside the hook (it runs per array).
    markers, dtypes, itemsizes, frombuffer = _MARKERS, _DTYPES, _ITEMSIZES, np.frombuffer
    one_dim = _MARKERS[1].unpack

    def ext_hook(code: int, data: bytes) -> np.ndarray:
        if code == 1 and len(data) == 14:  # one dimension, the common case: every check in one test
            index, dtype_code, marked_ndim, count = one_dim(data)
            if (
                marked_ndim == 1
                and 0 < index < n_frames
                and not used[index]
                and dtype_code < 12
                and 0 < count
                and count * itemsizes[dtype_code] == lengths[index]
            ):
                used[index] = True
                return frombuffer(bases[index], dtypes[dtype_code], count, offsets[index])
        size = len(data) - 6  # the marker's fixed part; then 8 bytes per dim
        if code != 1 or size & 7 or not 0 <= size <= 8 * MAX_NDIM:
            raise WireFormatError(f"unknown msgpack extension (type {code}, {len(data)} bytes)")
        index, dtype_code, marked_ndim, *shape = markers[size >> 3].unpack(data)
        if marked_ndim != size >> 3 or not 0 < index < n_frames or used[index] or dtype_code >= 12:
            raise WireFormatError(_bad_marker(index, dtype_code, marked_ndim, shape, n_frames, used))
        used[index] = True
        dtype = dtypes[dtype_code]
        count = 1
        for dim in shape:
            if dim < 0:
                raise WireFormatError(_bad_shape(index, lengths[index], shape, dtype))
            count *= dim
        if count * itemsizes[dtype_code] != lengths[index]:
            raise WireFormatError(_bad_shape(index, lengths[index], shape, dtype))
        if count == 0:
            return np.empty(shape, dtype)
        return frombuffer(bases[index], dtype, count, offsets[index]).reshape(shape)

    try:
        obj = msgpack.unpackb(
            head[len(_HEADER) :],
            ext_hook=ext_hook,
            raw=False,
            strict_map_key=False,  # int keys are allowed; key types are checked below
            use_list=True,
        )
    except WireFormatError:
        raise
    except Exception as e:  # msgpack's many error types, bad UTF-8, unhashable keys, ...
        raise WireFormatError(f"bad msgpack structure: {type(e).__name__}: {e}") from None
    if not all(used):
        unused = [i for i in range(n_frames) if not used[i]]
        raise WireFormatError(f"frames {unused} are not referenced by any array marker")
    if type(obj) not in _LEAVES:
        _validate(obj, 0, max_depth)
    return obj


def decode(
    frames: Sequence[Any],
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> Any:
    """The object `encode` made `frames` from. `frames` are bytes-like
    (bytes, memoryview, zmq.Frame). Arrays are views over their frames.
    Raises WireFormatError (only) for anything malformed."""
    buffers = []
    total = 0
    try:
        for frame in frames:
            view = memoryview(frame)
            if view.format != "B" or view.ndim != 1:
                view = view.cast("B")  # raises for non-contiguous buffers
            buffers.append(view)
            total += view.nbytes
    except (TypeError, ValueError) as e:
        raise WireFormatError(f"frames must be contiguous bytes-like objects: {e}") from None
    if not 1 <= len(buffers) <= MAX_FRAMES:
        raise WireFormatError(f"a message has 1..{MAX_FRAMES} frames, got {len(buffers)}")
    if total > max_message_bytes:
        raise WireFormatError(f"message of {total} bytes exceeds the limit of {max_message_bytes} bytes")
    return _decode_frames(buffers, [0] * len(buffers), [b.nbytes for b in buffers], max_depth)


# ---- one-buffer form (what the streams send) ------------------------------------
#
# pyzmq spends a few microseconds of Python per part of a multipart message,
# more than everything else a trajectory costs. The streams therefore send one
# zmq frame per message: the frames above joined behind a table of their
# lengths, each frame starting at an 8-byte offset so the arrays `loads`
# returns are aligned whenever the transport's buffer is. The join is one copy
# (the one a copying zmq send would make anyway); `loads` only slices.
#
#   b"RJ" | version u8 | 0 u8 | n_frames u32 | n_frames x length u64 | frame 0 | pad | frame 1 | pad | ... | frame n-1

_JOIN_MAGIC = b"RJ"
_JOIN_HEAD = struct.Struct("<2sBBI")
_JOIN_TABLES: dict[int, struct.Struct] = {}
_PADS = [b"\0" * k for k in range(8)]


def _table(n: int) -> struct.Struct:
    table = _JOIN_TABLES.get(n)
    if table is None:
        table = _JOIN_TABLES[n] = struct.Struct(f"<{n}Q")
    return table


def _join_parts(head: bytes, buffers: list) -> tuple[list, int]:
    """(the pieces of the one-buffer form in order, their total size). Buffers are bytes-like
    and contiguous (bytes, memoryviews, C-contiguous arrays)."""
    n = len(buffers) + 1
    if n > MAX_FRAMES:
        raise ValueError(f"wire: at most {MAX_FRAMES - 1} arrays per message, got {n - 1}")
    lengths = [b.nbytes if type(b) is np.ndarray else memoryview(b).nbytes for b in buffers]
    parts: list = [_JOIN_HEAD.pack(_JOIN_MAGIC, VERSION, 0, n), _table(n).pack(len(head), *lengths), head]
    size = _JOIN_HEAD.size + 8 * n + len(head)
    for buffer, length in zip(buffers, lengths):
        if size & 7:
            parts.append(_PADS[8 - (size & 7)])
            size += 8 - (size & 7)
        parts.append(buffer)
        size += length
    return parts, size


def _join(head: bytes, buffers: list) -> bytes:
    return b"".join(_join_parts(head, buffers)[0])


def join_frames(frames: Sequence[Any]) -> bytes:
    """One buffer holding `frames` (as `split_frames` reads it back)."""
    if not frames:
        raise ValueError("join_frames: no frames")
    return _join(bytes(frames[0]), list(frames[1:]))


def _frame_table(buffer: Any, max_message_bytes: int) -> tuple[memoryview, list[int], tuple[int, ...]]:
    """(the buffer as bytes, each frame's offset, each frame's length), validated."""
    try:
        view = memoryview(buffer)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
    except (TypeError, ValueError) as e:
        raise WireFormatError(f"message must be a contiguous bytes-like object: {e}") from None
    size = view.nbytes
    if size > max_message_bytes:
        raise WireFormatError(f"message of {size} bytes exceeds the limit of {max_message_bytes} bytes")
    if size < _JOIN_HEAD.size:
        raise WireFormatError(f"message of {size} bytes is too short to be a realrl message")
    magic, version, _, n = _JOIN_HEAD.unpack_from(view)
    if magic != _JOIN_MAGIC:
        raise WireFormatError("not a realrl wire message (bad magic)")
    if version != VERSION:
        raise WireFormatError(f"wire format version {version} is not supported (this side speaks {VERSION})")
    end = _JOIN_HEAD.size + 8 * n
    if not 1 <= n <= MAX_FRAMES or end > size:
        raise WireFormatError(f"bad frame count {n} for a message of {size} bytes")
    lengths = _table(n).unpack_from(view, _JOIN_HEAD.size)
    offsets = []
    for length in lengths:
        offset = (end + 7) & ~7
        end = offset + length
        if end > size:
            raise WireFormatError(f"frame lengths exceed the message size ({size} bytes)")
        offsets.append(offset)
    if end != size:
        raise WireFormatError(f"{size - end} trailing bytes after the last frame")
    return view, offsets, lengths


def split_frames(buffer: Any, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[memoryview]:
    """The frames `join_frames` joined, as memoryviews into `buffer` (no copy)."""
    view, offsets, lengths = _frame_table(buffer, max_message_bytes)
    return [view[o : o + n] for o, n in zip(offsets, lengths)]


def dumps(obj: Any) -> bytes:
    """`obj` as one buffer (the frames of `encode(obj)`, joined)."""
    head, arrays = _pack(obj)
    return _join(head, arrays)


def dump_into(obj: Any, out: io.BytesIO) -> memoryview:
    """`dumps(obj)` written over the start of `out`, a buffer its owner reuses; a view of
    those bytes. (A large new `bytes` per message is fresh memory that the kernel maps and
    zeroes page by page, which cost more than encoding the message.) While a view of `out`
    exists, `out` refuses to be written (BufferError): release the view once nothing reads
    the bytes any more (after a zero-copy send: once its tracker is done)."""
    head, arrays = _pack(obj)
    parts, size = _join_parts(head, arrays)
    out.seek(0)
    out.writelines(parts)
    with out.getbuffer() as whole:
        return whole[:size]


def loads(buffer: Any, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_depth: int = DEFAULT_MAX_DEPTH) -> Any:
    """The object in a `dumps` buffer; arrays are views into `buffer`.
    Raises WireFormatError (only) for anything malformed."""
    view, offsets, lengths = _frame_table(buffer, max_message_bytes)
    return _decode_frames([view] * len(lengths), offsets, lengths, max_depth)
