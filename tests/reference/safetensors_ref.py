#!/usr/bin/python3
"""Independent safetensors reader/writer for cross-checking common/model/safetensors.cc.

Parses and writes the format with struct + json + numpy only (no `safetensors` package, no
torch), following https://github.com/huggingface/safetensors: 8-byte little-endian header length
N, N bytes of JSON header, then the data buffer; data_offsets are relative to the buffer.

Usage (prints one JSON object on stdout):
  safetensors_ref.py read FILE              tensors, metadata and layout facts of FILE
  safetensors_ref.py read-checkpoint DIR    the same for DIR/model.safetensors or its shards
  safetensors_ref.py write FILE             writes fixed F16/BF16/F32/I64/I32/U8/BOOL tensors
  safetensors_ref.py write-checkpoint DIR   writes two shards + model.safetensors.index.json
"""

import json
import os
import struct
import sys

import numpy as np

# BF16 has no numpy dtype: it is read as uint16 and widened by hand.
DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("u1"),
}


def bf16_bits_to_f32(bits):
    """uint16 BF16 bit patterns -> float32 (BF16 is the top half of an IEEE float32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(values):
    """float32 -> BF16 bits, rounding to nearest, ties to even (finite inputs only)."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounding = 0x7FFF + ((bits >> 16) & 1)
    return ((bits + rounding) >> 16).astype(np.uint16)


def to_python(dtype, raw):
    """Flat raw little-endian array -> list of Python numbers (floats exact as float64)."""
    if dtype == "BF16":
        return bf16_bits_to_f32(raw).astype(np.float64).tolist()
    if dtype in ("F64", "F32", "F16"):
        return raw.astype(np.float64).tolist()
    if dtype == "BOOL":
        return [bool(v) for v in raw.tolist()]
    return raw.tolist()


def read_file(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header_bytes = blob[8 : 8 + n]
    header = json.loads(header_bytes.decode("utf-8"))
    data = blob[8 + n :]
    out = {
        "header_len": n,
        "data_start": 8 + n,
        "header_padding_is_spaces": header_bytes.rstrip(b" ").endswith(b"}"),
        "header_keys": list(header.keys()),  # order as in the file
        "data_len": len(data),
        "metadata": header.get("__metadata__", {}),
        "tensors": {},
    }
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        count = int(np.prod(info["shape"], dtype=np.int64)) if info["shape"] else 1
        assert end - begin == count * dtype.itemsize, (name, info)
        assert end <= len(data), (name, info)
        raw = np.frombuffer(data[begin:end], dtype=dtype)
        values = to_python(info["dtype"], raw)
        out["tensors"][name] = {
            "dtype": info["dtype"],
            "shape": info["shape"],
            "data_offsets": [begin, end],
            "values": values,
            "sum": float(sum(float(v) for v in values)),
        }
    return out


def read_checkpoint(directory):
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(single):
        parsed = read_file(single)
        for t in parsed["tensors"].values():
            t["file"] = "model.safetensors"
        return {"index": None, "tensors": parsed["tensors"]}
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors = {}
    parsed_shards = {}
    for name, shard in index["weight_map"].items():
        if shard not in parsed_shards:
            parsed_shards[shard] = read_file(os.path.join(directory, shard))
        t = parsed_shards[shard]["tensors"][name]
        t["file"] = shard
        tensors[name] = t
    return {"index": index, "tensors": tensors}


def write_file(path, tensors, metadata=None):
    """tensors: list of (name, dtype, shape, raw little-endian numpy array), laid out in order."""
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, raw in tensors:
        nbytes = raw.nbytes
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, raw in tensors:
            f.write(raw.tobytes())


def fixture_tensors():
    """The tensors `write` produces; values are rounded here, by numpy and by hand, not by torch."""
    f16_in = [1.0, -2.5, 0.1, 65504.0, 2.0**-24, -0.0, 1.0 / 3.0]
    bf16_in = [1.0, -123.5, 0.1, 3.0e38, 1.0 / 3.0, 2.0**-130]
    f16 = np.asarray(f16_in, dtype="<f2").reshape(7, 1)
    bf16 = f32_to_bf16_bits(bf16_in).reshape(2, 3)
    return [
        # Deliberately not sorted by name or width: the reader must follow data_offsets.
        ("half", "F16", [7, 1], f16),
        ("brain", "BF16", [2, 3], bf16),
        ("flags", "BOOL", [3], np.asarray([1, 0, 1], dtype="u1")),
        ("ids", "I64", [2, 2], np.asarray([[-(2**40), 7], [0, 2**62]], dtype="<i8")),
        ("int32", "I32", [3], np.asarray([-7, 0, 2**31 - 1], dtype="<i4")),
        ("single", "F32", [2], np.asarray([0.1, -1e-30], dtype="<f4")),
        ("bytes", "U8", [4], np.asarray([0, 1, 128, 255], dtype="u1")),
        ("empty", "F32", [0, 5], np.zeros((0, 5), dtype="<f4")),
    ]


def describe(tensors, metadata=None):
    return {
        "metadata": metadata or {},
        "tensors": {
            name: {"dtype": dtype, "shape": shape, "values": to_python(dtype, raw.reshape(-1))}
            for name, dtype, shape, raw in tensors
        },
    }


def main(argv):
    command, target = argv[1], argv[2]
    if command == "read":
        result = read_file(target)
    elif command == "read-checkpoint":
        result = read_checkpoint(target)
    elif command == "write":
        tensors = fixture_tensors()
        metadata = {"format": "pt", "writer": "safetensors_ref.py"}
        write_file(target, tensors, metadata)
        result = describe(tensors, metadata)
    elif command == "write-checkpoint":
        tensors = fixture_tensors()
        os.makedirs(target, exist_ok=True)
        shards = {"model-00001-of-00002.safetensors": tensors[:3],
                  "model-00002-of-00002.safetensors": tensors[3:]}
        weight_map = {}
        for shard, part in shards.items():
            write_file(os.path.join(target, shard), part, {"format": "pt"})
            weight_map.update({name: shard for name, _, _, _ in part})
        total = sum(raw.nbytes for _, _, _, raw in tensors)
        with open(os.path.join(target, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        result = describe(tensors)
        result["weight_map"] = weight_map
    else:
        raise SystemExit("unknown command " + command)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv)
