"""What the CLI tests share: the `lmoe` binary under test, the source tree's paths, bf16 bits,
safetensors files written and read with numpy alone, random tail inputs and the tail's math in
float64, and the runner every test file ends with (`python3 test_X.py PATH_TO_LMOE`)."""

import json
import os
import struct
import subprocess
import sys
import unittest

import numpy as np

LMOE = None  # the binary under test, set by main()
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the source tree
DATA_DIR = os.path.join(ROOT, "tests", "data")




def to_bf16_bits(x):
    """float32 → bf16 bits, round to nearest even (as lmoe does)."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def from_bf16_bits(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path, tensors, metadata=None, header_override=None):
    """tensors: name → (dtype string, shape, raw bytes)."""
    header = {}
    offset = 0
    blobs = []
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    if metadata:
        header["__metadata__"] = metadata
    text = (header_override if header_override is not None else json.dumps(header)).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_output(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    entry = header["output"]
    begin, end = entry["data_offsets"]
    raw = data[8 + n + begin : 8 + n + end]
    assert entry["dtype"] == "BF16", entry
    return from_bf16_bits(np.frombuffer(raw, dtype=np.uint16)).reshape(entry["shape"]), header


def make_case(tp, tokens, d, l, seed):
    rng = np.random.default_rng(seed)
    routed = to_bf16_bits(rng.standard_normal((tp, tokens, l), dtype=np.float32))
    shared = to_bf16_bits(rng.standard_normal((tp, tokens, d), dtype=np.float32))
    gamma = to_bf16_bits(1 + 0.1 * rng.standard_normal(l, dtype=np.float32))
    w_up = to_bf16_bits(rng.standard_normal((d, l), dtype=np.float32) / np.sqrt(l))
    return routed, shared, gamma, w_up


def expected_tail(routed, shared, gamma, w_up, eps):
    """The tail's math in float64 from the stored bf16 values (no intermediate rounding)."""
    x = from_bf16_bits(routed).astype(np.float64).sum(axis=0)
    rstd = 1.0 / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps)
    n = x * rstd * from_bf16_bits(gamma).astype(np.float64)
    u = n @ from_bf16_bits(w_up).astype(np.float64).T
    return u + from_bf16_bits(shared).astype(np.float64).sum(axis=0)


def lmoe(*args, env=None, check=True):
    full_env = dict(os.environ)
    for name in list(full_env):
        # lmoe's own variables and NCCL's (timing settings among them, recorded in sweeps and tables)
        if name.startswith("LMOE_") or name.startswith("NCCL_"):
            del full_env[name]
    full_env.update(env or {})
    result = subprocess.run([LMOE, *args], capture_output=True, text=True, env=full_env, timeout=600)
    if check and result.returncode != 0:
        raise AssertionError(f"lmoe {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result



def main():
    """Runs the calling file's tests against the lmoe binary named first on the command line."""
    global LMOE
    LMOE = os.path.abspath(sys.argv.pop(1))
    unittest.main(module="__main__", verbosity=2)
