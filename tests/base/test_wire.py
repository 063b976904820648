"""The wire format: exact round-trips, zero-copy decoding, and validation of
everything a hostile peer could send (decode raises WireFormatError, only)."""

from __future__ import annotations

import io
import random
import struct

import msgpack
import numpy as np
import pytest
import torch

from realrl.base import wire
from realrl.base.wire import WireFormatError

ALL_DTYPES = [
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
]


def sample_structure() -> dict:
    rng = np.random.default_rng(0)
    arrays = {np.dtype(dt).name: (rng.standard_normal((3, 4)) * 100).astype(dt) for dt in ALL_DTYPES}
    return {
        "qid": "q-ü-1",
        "reward": -1.25,
        "prompt_len": 17,
        "big": 2**63 - 1,
        "neg": -(2**63),
        "flags": [True, False, None],
        "blob": b"\x00\xffraw",
        "tuple": (1, "two", np.arange(3, dtype=np.int32)),
        7: {"int key": 1},
        "arrays": arrays,
        "nested": [[{"deep": np.ones((2, 2, 2), np.float32)}]],
        "scalar0d": np.array(3.5),
        "empty": np.zeros((0, 5), np.int64),
        "np_scalars": [np.float32(0.5), np.int64(-3), np.bool_(True), np.uint8(200)],
    }


def assert_same(expected, got):
    if isinstance(expected, np.ndarray):
        assert isinstance(got, np.ndarray)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)
    elif isinstance(expected, (list, tuple)):
        assert type(got) is list and len(got) == len(expected)
        for e, g in zip(expected, got):
            assert_same(e, g)
    elif isinstance(expected, dict):
        assert type(got) is dict and list(got) == list(expected)
        for k in expected:
            assert_same(expected[k], got[k])
    elif isinstance(expected, np.generic):
        assert type(got) is type(expected.item()) and got == expected.item()
    else:
        assert type(got) is type(expected) and got == expected


@pytest.mark.parametrize("form", ["frames", "buffer"])
def test_round_trip_is_exact(form):
    obj = sample_structure()
    got = wire.decode(wire.encode(obj)) if form == "frames" else wire.loads(wire.dumps(obj))
    assert_same(obj, got)


def test_dump_into_writes_dumps_bytes_over_a_reused_buffer_and_guards_them_while_viewed():
    """`dump_into` gives the bytes `dumps` gives, over the start of a buffer its
    owner reuses (a smaller message after a larger one: only its own bytes); the
    buffer refuses to be written while a view of them exists."""
    out = io.BytesIO()
    big, small = sample_structure(), {"x": np.arange(3, dtype=np.int16)}
    view = wire.dump_into(big, out)
    assert bytes(view) == wire.dumps(big)
    assert_same(big, wire.loads(view))
    with pytest.raises(BufferError):
        wire.dump_into(small, out)
    view.release()
    view = wire.dump_into(small, out)
    assert bytes(view) == wire.dumps(small) and view.nbytes < len(wire.dumps(big))
    assert_same(small, wire.loads(view))


def test_odd_arrays_round_trip():
    base = np.arange(60, dtype=np.int64).reshape(6, 10)
    cases = [
        base[:, ::3],  # not contiguous
        base.T,  # Fortran order
        np.arange(5, dtype=">i4"),  # big-endian
        np.array(True),
        np.zeros((2, 0, 3), np.float16),
        np.arange(7, dtype=np.int8),  # odd byte length: later frames need padding
    ]
    for array in cases:
        (got,) = wire.loads(wire.dumps([array, np.arange(3.0)]))[:1]
        np.testing.assert_array_equal(got, array)
        assert got.shape == array.shape and got.dtype == array.dtype.newbyteorder("<")


def test_torch_tensors_come_back_as_numpy():
    obj = {
        "f": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "i": torch.tensor([1, -2], dtype=torch.int64),
        "bf16": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
        "grad": torch.ones(2, requires_grad=True) * 2,
        "strided": torch.arange(10)[::2],
    }
    got = wire.loads(wire.dumps(obj))
    np.testing.assert_array_equal(got["f"], obj["f"].numpy())
    assert got["i"].dtype == np.int64
    assert got["bf16"].dtype == np.float32
    np.testing.assert_array_equal(got["bf16"], [1.5, -2.25])
    np.testing.assert_array_equal(got["grad"], [2.0, 2.0])
    np.testing.assert_array_equal(got["strided"], [0, 2, 4, 6, 8])


def test_encode_rejects_unsupported_values():
    bad_values = [
        {1, 2},
        object(),
        np.array([1 + 2j]),
        np.array(["text"]),
        np.array([object()]),
        2**64,
        np.ma.masked_array([1, 2], mask=[0, 1]),
        np.datetime64("2024-01-01"),
    ]
    for bad in bad_values:
        with pytest.raises((TypeError, OverflowError)):
            wire.encode({"x": bad})
    assert wire.loads(wire.dumps({"x": 1})) == {"x": 1}  # a failed encode leaves nothing behind


def test_encode_is_zero_copy_and_decode_shares_the_frames():
    array = np.arange(1000, dtype=np.float32)
    frames = wire.encode({"a": array, "b": [array[:10].copy()]})
    assert isinstance(frames[1], memoryview)
    assert np.shares_memory(np.frombuffer(frames[1], np.uint8), array)  # no copy on encode
    received = [bytes(f) for f in frames]  # what a transport would hand over
    got = wire.decode(received)
    assert np.shares_memory(got["a"], np.frombuffer(received[1], np.uint8))
    assert np.shares_memory(got["b"][0], np.frombuffer(received[2], np.uint8))
    buffer = wire.dumps({"a": array, "x": np.arange(3, dtype=np.int8), "y": np.arange(4.0)})
    got = wire.loads(buffer)
    whole = np.frombuffer(buffer, np.uint8)
    for key in "axy":
        assert np.shares_memory(got[key], whole)
    assert got["y"].ctypes.data % 8 == 0  # arrays are laid out on 8-byte offsets


def test_frames_are_rebuilt_exactly_by_join_and_split():
    frames = wire.encode({"a": np.arange(5, dtype=np.int8), "b": np.arange(3.0)})
    split = wire.split_frames(wire.join_frames(frames))
    assert [bytes(f) for f in split] == [bytes(f) for f in frames]


# ---- hostile input --------------------------------------------------------------------

HEADER = b"RL" + bytes([wire.VERSION])


def marker(index: int, dtype_code: int, shape: tuple, ndim: int | None = None) -> msgpack.ExtType:
    ndim = len(shape) if ndim is None else ndim
    return msgpack.ExtType(1, struct.pack(f"<IBB{len(shape)}q", index, dtype_code, ndim, *shape))


def frames_of(structure, *arrays: bytes) -> list[bytes]:
    return [HEADER + msgpack.packb(structure), *arrays]


def nested(depth: int):
    obj: list = []
    for _ in range(depth):
        obj = [obj]
    return obj


BAD_FRAMES = {
    "no frames": ([], "empty|1..65536"),
    "bad magic": ([b"XX\x01\x80"], "bad magic"),
    "future version": ([b"RL\x09\x80"], "version 9"),
    "short header": ([b"R"], "bad magic"),
    "bad msgpack": ([HEADER + b"\xc1"], "msgpack"),
    "trailing data": ([HEADER + msgpack.packb(1) + b"\x01"], "msgpack"),
    "truncated msgpack": ([HEADER + msgpack.packb({"a": "long string"})[:-3]], "msgpack"),
    "bad utf-8": ([HEADER + b"\xa2\xff\xfe"], "msgpack"),
    "frame index past end": (frames_of({"x": marker(2, 3, (1,))}, b"\0" * 4), "points at frame 2"),
    "frame index zero": (frames_of({"x": marker(0, 3, (1,))}, b"\0" * 4), "points at frame 0"),
    "frame used twice": (frames_of([marker(1, 3, (1,)), marker(1, 3, (1,))], b"\0" * 4), "twice"),
    "unreferenced frame": (frames_of({"x": 1}, b"\0" * 4), "not referenced"),
    "dtype not whitelisted": (frames_of({"x": marker(1, 12, (1,))}, b"\0" * 8), "whitelist"),
    "negative dim": (frames_of({"x": marker(1, 0, (-2, -3))}, b"\0" * 6), "negative"),
    "shape too big for frame": (frames_of({"x": marker(1, 3, (5,))}, b"\0" * 16), "needs 20"),
    "shape too small for frame": (frames_of({"x": marker(1, 4, (2, 1))}, b"\0" * 24), "needs 16"),
    "huge shape": (frames_of({"x": marker(1, 11, (2**62, 2**62))}, b"\0" * 8), "bytes; shape"),
    "ndim mismatch": (frames_of({"x": marker(1, 3, (4,), ndim=2)}, b"\0" * 16), "ndim"),
    "short marker": (frames_of({"x": msgpack.ExtType(1, b"\x01\x00")}, b"\0" * 4), "extension"),
    "too many dims": (frames_of({"x": marker(1, 3, (1,) * 40)}, b"\0" * 4), "extension"),
    "unknown ext type": (frames_of({"x": msgpack.ExtType(42, b"")}), "extension"),
    "timestamp ext": (frames_of({"x": msgpack.Timestamp(1, 0)}), "unsupported value"),
    "float dict key": (frames_of({1.5: 1}), "dict key"),
    "bytes dict key": ([HEADER + msgpack.packb({b"k": 1}, use_bin_type=True)], "dict key"),
    "too deep": (frames_of(nested(40)), "deeper"),
    "very deep": ([HEADER + b"\x91" * 5000 + b"\x90"], "msgpack|deeper"),  # past msgpack's own stack
    "not bytes": ([12345], "bytes-like"),
}


@pytest.mark.parametrize("case", list(BAD_FRAMES))
def test_decode_rejects(case):
    frames, match = BAD_FRAMES[case]
    with pytest.raises(WireFormatError, match=match):
        wire.decode(frames)


def test_size_limit():
    obj = {"x": np.zeros(1000, np.float64)}
    with pytest.raises(WireFormatError, match="exceeds the limit of 4000"):
        wire.decode(wire.encode(obj), max_message_bytes=4000)
    with pytest.raises(WireFormatError, match="exceeds the limit of 4000"):
        wire.loads(wire.dumps(obj), max_message_bytes=4000)
    assert wire.loads(wire.dumps(obj), max_message_bytes=9000)["x"].shape == (1000,)


def test_depth_limit_is_configurable():
    frames = wire.encode(nested(10))
    wire.decode(frames)
    with pytest.raises(WireFormatError, match="deeper than 5"):
        wire.decode(frames, max_depth=5)


JOIN_HEAD = struct.Struct("<2sBBI")
BAD_BUFFERS = {
    "empty": (b"", "too short"),
    "bad magic": (JOIN_HEAD.pack(b"XX", wire.VERSION, 0, 1) + struct.pack("<Q", 0), "bad magic"),
    "bad version": (JOIN_HEAD.pack(b"RJ", 99, 0, 1) + struct.pack("<Q", 0), "version 99"),
    "zero frames": (JOIN_HEAD.pack(b"RJ", wire.VERSION, 0, 0), "frame count 0"),
    "table past end": (JOIN_HEAD.pack(b"RJ", wire.VERSION, 0, 1000) + b"\0" * 16, "frame count 1000"),
    "length past end": (JOIN_HEAD.pack(b"RJ", wire.VERSION, 0, 1) + struct.pack("<Q", 2**63) + b"RL", "exceed"),
    "trailing bytes": (wire.dumps({"a": 1}) + b"\0", "trailing"),
    "truncated": (wire.dumps({"a": np.arange(3)})[:-1], "exceed"),
    "not bytes": (3.5, "bytes-like"),
}


@pytest.mark.parametrize("case", list(BAD_BUFFERS))
def test_loads_rejects(case):
    buffer, match = BAD_BUFFERS[case]
    with pytest.raises(WireFormatError, match=match):
        wire.loads(buffer)


def test_fuzzed_messages_decode_or_raise_wire_format_error_only():
    rng = random.Random(1234)
    obj = {
        "ids": np.arange(40, dtype=np.int32),
        "lp": np.linspace(0, 1, 9, dtype=np.float32),
        "meta": {"qid": "q", "r": 1.0, 3: [1, 2, (3, None)]},
        "m": np.ones((2, 3), np.uint8),
    }
    buffer = wire.dumps(obj)
    frames = [bytes(f) for f in wire.encode(obj)]
    outcomes = {"ok": 0, "rejected": 0}

    def mutate(data: bytes) -> bytes:
        data = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.6 and data:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif op < 0.8 and data:
                del data[rng.randrange(len(data)) :]
            else:
                pos = rng.randrange(len(data) + 1)
                data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 9)))
        return bytes(data)

    for trial in range(600):
        try:
            if trial % 2:
                wire.loads(mutate(buffer))
            else:
                target = rng.randrange(len(frames)) if trial % 4 else 0  # structure frame half the time
                mutated = list(frames)
                mutated[target] = mutate(frames[target])
                wire.decode(mutated)
            outcomes["ok"] += 1
        except WireFormatError:
            outcomes["rejected"] += 1
    assert outcomes["rejected"] > 100  # the mutations did hit the validation paths
