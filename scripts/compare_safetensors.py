#!/usr/bin/env python3
"""Compare one tensor of two safetensors files, e.g. lmoe's `lmoe tail` output with the PyTorch
baseline's (scripts/torch_baseline.py --dump-dir) on the same input.

    python3 scripts/compare_safetensors.py A.safetensors B.safetensors [--tensor output] [--max-rel 0.02]

Prints the shape, how many elements differ in bits, the largest absolute difference and the largest
difference relative to the largest |A|, and exits 1 when --max-rel is given and exceeded (or when the
shapes differ or a value is NaN in one file only). Reads with numpy (bf16 as its raw bits widened).
"""
import argparse
import json
import struct
import sys

import numpy as np

_NUMPY = {"F32": (np.float32, np.uint32), "F16": (np.float16, np.uint16), "F64": (np.float64, np.uint64)}


def load(path, name):
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        if name not in header:
            raise SystemExit(f"{path}: no tensor '{name}' (has: {', '.join(k for k in header if k != '__metadata__')})")
        info = header[name]
        begin, end = info["data_offsets"]
        f.seek(8 + header_len + begin)
        raw = f.read(end - begin)
    shape, dtype = info["shape"], info["dtype"]
    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).reshape(shape), np.frombuffer(raw, dtype=np.uint16).reshape(shape)
    if dtype not in _NUMPY:
        raise SystemExit(f"{path}: tensor '{name}' has dtype {dtype} (BF16, F16, F32, F64 are read)")
    float_type, bits_type = _NUMPY[dtype]
    return (np.frombuffer(raw, dtype=float_type).reshape(shape).astype(np.float64),
            np.frombuffer(raw, dtype=bits_type).reshape(shape))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--tensor", default="output")
    p.add_argument("--max-rel", type=float, help="fail when max |a-b| / max |a| exceeds this")
    args = p.parse_args()
    a, a_bits = load(args.a, args.tensor)
    b, b_bits = load(args.b, args.tensor)
    if a.shape != b.shape:
        print(f"shapes differ: {list(a.shape)} vs {list(b.shape)}")
        return 1
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    nan_mismatch = int(np.count_nonzero(np.isnan(a64) != np.isnan(b64)))
    finite = ~(np.isnan(a64) | np.isnan(b64))
    diff = np.abs(a64 - b64)[finite]
    scale = float(np.max(np.abs(a64[finite]))) if finite.any() else 0.0
    max_abs = float(diff.max()) if diff.size else 0.0
    rel = max_abs / scale if scale > 0 else max_abs
    differing = int(np.count_nonzero(a_bits != b_bits)) if a_bits.dtype == b_bits.dtype else -1
    print(f"{args.tensor} {list(a.shape)}: {differing} of {a.size} elements differ in bits; max |a-b| {max_abs:.4g}; "
          f"max |a-b| / max |a| {rel:.4g}; NaN in one only: {nan_mismatch}")
    if nan_mismatch or (args.max_rel is not None and rel > args.max_rel):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
