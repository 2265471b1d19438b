"""End-to-end tests of the `lmoe` tool: `tail` on safetensors files (checked against an
independent numpy implementation of the tail), malformed files, `explain`, `run --json`, bad
environment variables, `bench`, `tune` and its tier tables, tables derived from and checked against
recorded sweeps (`--from-sweep`, on a CPU sweep and on the H200 recordings of tests/data/), and
scripts/plot_bench.py's data preparation. Usage: test_cli.py PATH_TO_LMOE"""

import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy as np

LMOE = None
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the source tree


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


class TailCommand(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        # Kimi-K3 dims, tp 8: the 7168 × 3584 up-projection and every tier's stripes at full size.
        cls.tp, cls.tokens, cls.d, cls.l = 8, 19, 7168, 3584
        cls.case = make_case(cls.tp, cls.tokens, cls.d, cls.l, seed=7)
        routed, shared, gamma, w_up = cls.case
        cls.input = os.path.join(cls.dir.name, "k3_tp8.safetensors")
        write_safetensors(
            cls.input,
            {
                "routed": ("BF16", routed.shape, routed.tobytes()),
                "shared": ("BF16", shared.shape, shared.tobytes()),
                "norm.weight": ("BF16", gamma.shape, gamma.tobytes()),
                "up_proj.weight": ("BF16", w_up.shape, w_up.tobytes()),
            },
            metadata={"eps": "1e-05"},
        )
        cls.expected = expected_tail(*cls.case, eps=1e-5)

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def run_tier(self, tier):
        out = os.path.join(self.dir.name, f"out_{tier}.safetensors")
        result = lmoe("tail", "--input", self.input, "--output", out, "--tier", tier, "--backend", "cpu", "--check")
        y, header = read_output(out)
        self.assertEqual(list(y.shape), [self.tokens, self.d])
        self.assertEqual(header["__metadata__"]["tier"], tier)
        return y, result

    def test_every_tier_writes_the_right_output(self):
        outputs = {}
        for tier in ["fused", "overlap", "column", "token"]:
            with self.subTest(tier=tier):
                y, result = self.run_tier(tier)
                self.assertIn(f"tier: {tier}", result.stdout)
                error = np.linalg.norm(y - self.expected) / np.linalg.norm(self.expected)
                self.assertLess(error, 1e-2)
                self.assertTrue(np.isfinite(y).all())
                outputs[tier] = y
        # fused, overlap and token share one contract; their bf16 outputs agree closely.
        for tier in ["overlap", "token"]:
            self.assertLess(np.abs(outputs[tier] - outputs["fused"]).max(), 0.1)

    def test_auto_says_which_tier_and_why(self):
        out = os.path.join(self.dir.name, "out_auto.safetensors")
        result = lmoe("tail", "--input", self.input, "--output", out, "--backend", "cpu")
        self.assertIn("tier: fused", result.stdout)
        self.assertIn("T=19 <= fused_max_tokens=128", result.stdout)
        self.assertIn("eps=1e-05 (__metadata__ eps)", result.stderr)


class MalformedFiles(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.tp, self.tokens, self.d, self.l = 2, 3, 32, 16
        self.case = make_case(self.tp, self.tokens, self.d, self.l, seed=3)

    def tearDown(self):
        self.dir.cleanup()

    def tensors(self):
        routed, shared, gamma, w_up = self.case
        return {
            "routed": ("BF16", routed.shape, routed.tobytes()),
            "shared": ("BF16", shared.shape, shared.tobytes()),
            "norm.weight": ("BF16", gamma.shape, gamma.tobytes()),
            "up_proj.weight": ("BF16", w_up.shape, w_up.tobytes()),
        }

    def expect_error(self, path, *needles):
        out = os.path.join(self.dir.name, "out.safetensors")
        result = lmoe("tail", "--input", path, "--output", out, "--backend", "cpu", check=False)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertIn("lmoe: error:", result.stderr)
        for needle in needles:
            self.assertIn(needle, result.stderr)
        self.assertFalse(os.path.exists(out))

    def test_valid_small_file_works(self):
        path = os.path.join(self.dir.name, "ok.safetensors")
        write_safetensors(path, self.tensors())
        out = os.path.join(self.dir.name, "out.safetensors")
        lmoe("tail", "--input", path, "--output", out, "--backend", "cpu", "--check")
        y, _ = read_output(out)
        expected = expected_tail(*self.case, eps=1e-5)
        self.assertLess(np.linalg.norm(y - expected) / np.linalg.norm(expected), 1e-2)

    def test_truncated_file(self):
        path = os.path.join(self.dir.name, "t.safetensors")
        write_safetensors(path, self.tensors())
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[:-10])
        self.expect_error(path, "t.safetensors")

    def test_missing_tensor(self):
        path = os.path.join(self.dir.name, "m.safetensors")
        tensors = self.tensors()
        del tensors["norm.weight"]
        write_safetensors(path, tensors)
        self.expect_error(path, "missing tensor 'norm.weight'")

    def test_wrong_shape(self):
        path = os.path.join(self.dir.name, "s.safetensors")
        tensors = self.tensors()
        w = tensors["up_proj.weight"][2]
        tensors["up_proj.weight"] = ("BF16", (self.l, self.d), w)
        write_safetensors(path, tensors)
        self.expect_error(path, "tensor 'up_proj.weight' has shape [16, 32], expected [32, 16]")

    def test_mixed_dtypes(self):
        path = os.path.join(self.dir.name, "d.safetensors")
        tensors = self.tensors()
        g = from_bf16_bits(self.case[2])
        tensors["norm.weight"] = ("F32", g.shape, g.astype(np.float32).tobytes())
        write_safetensors(path, tensors)
        self.expect_error(path, "tensor 'norm.weight' is F32 but routed is BF16")

    def test_garbage_header(self):
        path = os.path.join(self.dir.name, "g.safetensors")
        write_safetensors(path, self.tensors(), header_override="{not json")
        self.expect_error(path, "g.safetensors")

    def test_absurd_header_length(self):
        path = os.path.join(self.dir.name, "h.safetensors")
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", 1 << 60) + b"{}")
        self.expect_error(path, "h.safetensors")

    def test_unknown_dtype(self):
        path = os.path.join(self.dir.name, "u.safetensors")
        tensors = self.tensors()
        g = from_bf16_bits(self.case[2]).astype(np.float64)
        tensors["norm.weight"] = ("F64", g.shape, g.tobytes())
        write_safetensors(path, tensors)
        self.expect_error(path, "F64")

    def test_missing_file(self):
        self.expect_error(os.path.join(self.dir.name, "nope.safetensors"), "nope.safetensors")


class OtherCommands(unittest.TestCase):
    def test_explain_lists_every_tier(self):
        result = lmoe("explain", "--tokens", "3", "--tp", "4", "--preset", "kimi-k3", "--backend", "cpu")
        for tier in ["fused", "overlap", "column", "token"]:
            self.assertIn(tier, result.stdout)
        self.assertIn("T=3 < tp=4", result.stdout)

    def test_explain_env_and_forced_tier(self):
        result = lmoe("explain", "--tokens", "100", "--tp", "8", "--backend", "cpu", env={"LMOE_FUSED_MAX_TOKENS": "64"})
        self.assertIn("→ overlap", result.stdout)
        self.assertIn("LMOE_FUSED_MAX_TOKENS=64", result.stdout)
        result = lmoe("explain", "--tokens", "100", "--tp", "8", "--backend", "cpu", env={"LMOE_TIER": "token"})
        self.assertIn("→ token (forced: LMOE_TIER=token)", result.stdout)

    def test_explain_gives_each_tiers_floor_on_given_rates(self):
        result = lmoe("explain", "--tokens", "128", "--tp", "8", "--backend", "cpu", "--rates", "450,4270,790")
        self.assertIn("floors at T=128, one rank per GPU, at link 450 GB/s, memory 4270 GB/s, GEMM 790 TFLOP/s (--rates):",
                      result.stdout)
        rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines()
                if line.split()[:1] in (["fused"], ["overlap"], ["column"], ["token"]) and len(line.split()) == 6}
        # K3 at tp 8, T = 128: fused's one-shot latent sends (tp - 1)·T·l·2 bytes + the stripes of
        # shared and Y; column the two all-reduces; overlap and token read all of w_up.
        fused_bytes = 7 * 128 * 3584 * 2 + 2 * 7 / 8 * 128 * 7168 * 2
        self.assertEqual(rows["fused"], [f"{fused_bytes / 450e3:.2f}"] * 2 + ["2.58", "1.04", "links"])
        self.assertEqual(rows["column"][0], f"{2 * 7 / 8 * 128 * 2 * (3584 + 7168) / 450e3:.2f}")
        self.assertEqual(rows["overlap"][-1], "memory")
        # No rates: says so; bad rates: an error before anything is printed.
        result = lmoe("explain", "--tokens", "1", "--tp", "2", "--backend", "cpu")
        self.assertIn("floors: no rates known for the cpu backend (give --rates", result.stdout)
        result = lmoe("explain", "--tokens", "1", "--backend", "cpu", "--rates", "1,2,x", check=False)
        self.assertEqual(result.returncode, 2)
        self.assertEqual(result.stdout, "")
        self.assertIn("got 'x'", result.stderr)

    def test_bad_environment_variable_names_it(self):
        result = lmoe("explain", "--tokens", "1", "--backend", "cpu", env={"LMOE_OVERLAP_MAX_TOKENS": "lots"}, check=False)
        self.assertEqual(result.returncode, 2)
        self.assertIn("LMOE_OVERLAP_MAX_TOKENS='lots'", result.stderr)

    def test_run_writes_json_with_every_row_ok(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "run.json")
            result = lmoe("run", "--preset", "small", "-n", "3", "-t", "0,1,2,3,129", "--backend", "cpu", "--json", path)
            self.assertIn("all rows ok", result.stdout)
            with open(path) as f:
                doc = json.load(f)
            self.assertTrue(doc["ok"])
            self.assertEqual(doc["comm"], "threads")
            self.assertIn("comm threads", result.stdout)
            self.assertEqual([row["tokens"] for row in doc["rows"]], [0, 1, 2, 3, 129])
            self.assertEqual(doc["rows"][2]["tiers"]["token"]["status"], "declined")
            self.assertEqual(doc["rows"][3]["tiers"]["token"]["status"], "ran")
            self.assertEqual(doc["rows"][4]["chosen"], "overlap")

    def test_comm_must_serve_the_backend(self):
        result = lmoe("run", "--preset", "small", "-n", "2", "-t", "1", "--backend", "cpu", "--comm", "nccl", check=False)
        self.assertEqual(result.returncode, 2)
        self.assertIn("--comm nccl: not available for the cpu backend here (choices: threads)", result.stderr)
        result = lmoe("run", "--preset", "small", "-n", "2", "-t", "1", "--backend", "cpu", "--comm", "threads")
        self.assertIn("all rows ok", result.stdout)

    def test_unknown_preset(self):
        result = lmoe("run", "--preset", "gpt-9", check=False)
        self.assertEqual(result.returncode, 2)
        self.assertIn("unknown preset 'gpt-9'", result.stderr)


class LayerCommand(unittest.TestCase):
    def test_help_offers_only_presets_with_a_layer(self):
        # nemotron-3-ultra has tail dims but no layer description: `layer` refuses it, so its help
        # leaves it out, while the tail commands offer it.
        self.assertIn("nemotron-3-ultra", lmoe("run", "--help").stdout)
        layer_help = lmoe("layer", "--help").stdout
        self.assertIn("model dims: kimi-k3, nemotron-3-super, small", layer_help)
        self.assertNotIn("nemotron-3-ultra", layer_help)
        refused = lmoe("layer", "--preset", "nemotron-3-ultra", "-t", "1", check=False)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("--preset nemotron-3-ultra: no layer description", refused.stderr)

    def test_small_layer_writes_json_with_every_row_ok(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "layer.json")
            result = lmoe("layer", "--preset", "small", "--scale", "1", "-n", "2", "-t", "0,1,7", "--repeats", "2",
                          "--json", path)
            self.assertIn("all rows ok", result.stdout)
            for column in ["router_us", "down_us", "experts_us", "shared_us", "tail_us", "fp64_err", "row_err"]:
                self.assertIn(column, result.stdout)
            with open(path) as f:
                doc = json.load(f)
        self.assertTrue(doc["ok"])
        self.assertEqual(doc["command"], "layer")
        self.assertEqual((doc["d_model"], doc["d_latent"], doc["num_experts"], doc["top_k"]), (384, 192, 16, 4))
        self.assertEqual((doc["n_group"], doc["topk_group"], doc["tp"]), (4, 2, 2))
        self.assertEqual([row["tokens"] for row in doc["rows"]], [0, 1, 7])
        self.assertIsNone(doc["rows"][0]["tier"])
        self.assertFalse(doc["rows"][0]["checked"])
        for row in doc["rows"][1:]:
            self.assertTrue(row["checked"] and row["ok"] and row["ranks_identical"])
            self.assertLessEqual(row["normwise_error_vs_fp64"], row["normwise_tolerance"])
            self.assertLessEqual(row["max_row_error_vs_fp64"], row["row_tolerance"])
            for stage in ["router_us", "down_projection_us", "experts_us", "shared_us", "tail_us", "total_us"]:
                self.assertGreaterEqual(row[stage], 0)
            # The cpu backend runs the stages one after another: its forward's wall time is their sum.
            self.assertEqual(row["forward_us"], row["total_us"])

    def test_experts_override_the_presets_count(self):
        result = lmoe("layer", "--preset", "small", "--experts", "32", "-n", "1", "-t", "2", "--repeats", "1")
        self.assertIn("32 experts", result.stdout)
        self.assertIn("all rows ok", result.stdout)
        bad = lmoe("layer", "--preset", "small", "--experts", "2", "-n", "1", "-t", "2", check=False)
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("num_experts = 2", bad.stderr)

    def test_kimi_k3_scaled_down_runs(self):
        result = lmoe("layer", "--scale", "32", "-n", "2", "-t", "3", "--repeats", "1", "--tier", "overlap")
        self.assertIn("kimi-k3 scaled down 32x: d 224, l 112", result.stdout)
        self.assertIn("situ_glu", result.stdout)
        self.assertIn("overlap", result.stdout)
        self.assertIn("all rows ok", result.stdout)

    @staticmethod
    def write_small_checkpoint(path, layer, skip=()):
        """The small preset's layer (d 384, l 192, 16 experts, I 64, shared 2 x 48) by its tensor names."""
        rng = np.random.default_rng(3)
        d, l, experts, inter, shared = 384, 192, 16, 64, 96
        moe = f"layers.{layer}.moe."

        def bf16(shape, fan_in, center=0.0):
            values = center + rng.uniform(-1, 1, size=shape) * np.sqrt(3.0 / fan_in)
            return ("BF16", shape, to_bf16_bits(values).tobytes())

        tensors = {
            moe + "router.weight": ("F32", (experts, d),
                                    (rng.uniform(-1, 1, (experts, d)) * np.sqrt(3.0 / d)).astype(np.float32).tobytes()),
            moe + "router.bias": ("F32", (experts,), rng.uniform(-0.05, 0.05, experts).astype(np.float32).tobytes()),
            moe + "latent_down.weight": bf16((l, d), d),
            moe + "latent_norm.weight": bf16((l,), 300, center=1.0),
            moe + "latent_up.weight": bf16((d, l), l),
            moe + "shared.gate.weight": bf16((shared, d), d),
            moe + "shared.up.weight": bf16((shared, d), d),
            moe + "shared.down.weight": bf16((d, shared), shared),
        }
        for e in range(experts):
            tensors[moe + f"experts.{e}.gate.weight"] = bf16((inter, l), l)
            tensors[moe + f"experts.{e}.up.weight"] = bf16((inter, l), l)
            tensors[moe + f"experts.{e}.down.weight"] = bf16((l, inter), inter)
        for name in skip:
            del tensors[name]
        write_safetensors(path, tensors)

    def test_loads_a_layer_from_a_checkpoint(self):
        with tempfile.TemporaryDirectory() as tmp:
            self.write_small_checkpoint(os.path.join(tmp, "model.safetensors"), layer=2)
            path = os.path.join(tmp, "layer.json")
            result = lmoe("layer", "--preset", "small", "--weights", tmp, "--layer", "2", "-n", "2", "-t", "1,7",
                          "--repeats", "1", "--json", path)
            self.assertIn("all rows ok", result.stdout)
            self.assertIn(f"small from {tmp} layer 2: d 384, l 192", result.stdout)
            with open(path) as f:
                doc = json.load(f)
            self.assertEqual((doc["weights"], doc["layer"], doc["scale"]), (tmp, 2, 1))
            self.assertTrue(all(row["checked"] and row["ok"] for row in doc["rows"]))

            result = lmoe("layer", "--preset", "small", "--weights", tmp, "--layer", "3", "-t", "1", check=False)
            self.assertEqual(result.returncode, 2)
            self.assertIn(f"tensor 'layers.3.moe.router.weight': not found in {tmp}", result.stderr)
            self.write_small_checkpoint(os.path.join(tmp, "model.safetensors"), layer=2,
                                        skip=["layers.2.moe.experts.9.down.weight"])
            result = lmoe("layer", "--preset", "small", "--weights", tmp, "--layer", "2", "-t", "1", check=False)
            self.assertEqual(result.returncode, 2)
            self.assertIn("tensor 'layers.2.moe.experts.9.down.weight': not found", result.stderr)

    def test_nemotron_runs_without_the_latent_norm(self):
        # Nemotron 3 has no RMSNorm between the routed sum and its latent up-projection: the cpu
        # backend's tail skips it, and the layer still checks out against fp64 math.
        result = lmoe("layer", "--preset", "nemotron-3-super", "--scale", "16", "-t", "1,7")
        self.assertIn("all rows ok", result.stdout)
        self.assertIn("relu2", result.stderr)

    def test_bad_requests_name_the_cause(self):
        cases = [
            (["--preset", "nemotron-3-ultra"], "--preset nemotron-3-ultra: no layer description"),
            (["--weights", "/tmp"], "--weights and --layer: give both"),
            (["--preset", "nemotron-3-ultra", "--weights", "/tmp", "--layer", "0"], "no layer description"),
            (["--preset", "small", "--weights", "/nonexistent", "--layer", "0"], "/nonexistent: not a directory"),
            (["--scale", "0"], "--scale: expected a divisor"),
            (["--preset", "small", "--scale", "1", "-n", "3"], "expert_intermediate: expected a multiple of tp = 3, got 64"),
        ]
        for args, needle in cases:
            with self.subTest(args=args):
                result = lmoe("layer", *args, check=False)
                self.assertEqual(result.returncode, 2, result.stderr)
                self.assertIn(needle, result.stderr)


class BenchCommand(unittest.TestCase):
    RECORD_FIELDS = [
        "comm", "tokens", "tier", "status", "reason", "chosen", "mode", "mode_reason", "bytes", "bus_bytes",
        "median_us", "p10_us", "p90_us", "min_us", "max_us", "algbw_gbps", "busbw_gbps", "checked", "wrong",
        "bit_mismatches_vs_contract", "max_error_over_bound", "normwise_error_vs_fp64", "normwise_tolerance",
        "ranks_identical", "ok", "iterations_us", "elements",
    ]
    DOC_FIELDS = [
        "command", "tool", "version", "date", "hostname", "backend", "gpu", "nccl_version", "preset", "d_model",
        "d_latent", "dtype", "eps", "tp", "comms", "tiers", "tokens", "warmup", "iters", "seed", "check_max_tokens",
        "fault_injected", "definitions", "records", "comm_errors", "tier_table", "policy_check", "ok",
        "driver_version", "from_sweep", "cold_l2", "settings", "layers",
    ]

    def bench(self, *args, env=None, check=True):
        return lmoe("bench", "--backend", "cpu", "--preset", "small", *args, env=env, check=check)

    def test_timing_settings_are_recorded_and_named_in_the_header(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "bench.json")
            result = self.bench("-n", "2", "-t", "1", "--iters", "1", "--json", path,
                                env={"LMOE_TOKEN_CHUNKS": "2", "NCCL_ALGO": "Ring"})
            with open(path) as f:
                doc = json.load(f)
        self.assertEqual(doc["settings"], {"LMOE_TOKEN_CHUNKS": "2", "NCCL_ALGO": "Ring"})
        self.assertIn("1 timed iterations, with LMOE_TOKEN_CHUNKS=2 NCCL_ALGO=Ring\n", result.stderr)

    def test_json_has_every_field_and_every_record_is_right(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "bench.json")
            result = self.bench("-n", "2", "-t", "1,3,64", "--iters", "2", "--json", path)
            self.assertIn("all rows ok", result.stdout)
            self.assertIn("busbw_GB/s", result.stdout)
            self.assertIn("T=64", result.stderr)  # progress
            self.assertIn("ETA", result.stderr)
            with open(path) as f:
                doc = json.load(f)
        for field in self.DOC_FIELDS:
            self.assertIn(field, doc)
        self.assertEqual(doc["command"], "bench")
        self.assertTrue(doc["ok"])
        self.assertEqual((doc["tp"], doc["d_model"], doc["d_latent"], doc["dtype"]), (2, 384, 192, "bf16"))
        self.assertEqual(doc["comms"], ["threads"])
        self.assertEqual(doc["iters"], 2)
        self.assertIs(doc["cold_l2"], False)
        self.assertEqual(doc["layers"], 1)
        self.assertEqual(doc["settings"], {})
        self.assertIn("2 warm-up + 2 timed iterations\n", result.stderr)  # no ", L2 evicted before each"
        self.assertIsNone(doc["gpu"])
        records = doc["records"]
        keys = sorted((r["tokens"], r["tier"]) for r in records)
        self.assertEqual(keys, sorted((t, tier) for t in (1, 3, 64) for tier in ("fused", "overlap", "column", "token")))
        for record in records:
            with self.subTest(tokens=record["tokens"], tier=record["tier"]):
                for field in self.RECORD_FIELDS:
                    self.assertIn(field, record)
                self.assertEqual(record["comm"], "threads")
                if record["tokens"] == 1 and record["tier"] == "token":
                    self.assertEqual(record["status"], "declined")
                    self.assertIn("T=1 < tp=2", record["reason"])
                    continue
                self.assertEqual(record["status"], "ran")
                self.assertEqual(record["mode"], "eager")
                self.assertTrue(record["checked"])
                self.assertEqual(record["wrong"], 0)
                self.assertTrue(record["ranks_identical"])
                self.assertTrue(record["ok"])
                self.assertEqual(len(record["iterations_us"]), 2)
                times = sorted(record["iterations_us"])
                self.assertAlmostEqual(record["median_us"], (times[0] + times[1]) / 2, places=6)
                self.assertEqual(record["bytes"], record["tokens"] * (384 + 192) * 2)
                self.assertAlmostEqual(record["algbw_gbps"], record["bytes"] / record["median_us"] * 1e-3, places=9)
        chosen = {r["tokens"]: r["tier"] for r in records if r["chosen"]}
        self.assertEqual(chosen, {1: "fused", 3: "fused", 64: "fused"})
        # The declined tier has one line with its reason in the table.
        self.assertTrue(any("declined: T=1 < tp=2" in line for line in result.stdout.splitlines()))

    def test_layers_time_several_tails_and_check_them(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "bench.json")
            result = self.bench("-n", "2", "-t", "1,4", "--tiers", "fused,column", "--iters", "2", "--layers", "3",
                                "--json", path)
            with open(path) as f:
                doc = json.load(f)
        self.assertIn("all rows ok (4 checked", result.stdout)
        self.assertIn("2 timed iterations of 3 tails (layers, each its own weights; times per tail)", result.stderr)
        self.assertIn("of 3 tails", result.stdout)  # the table's header line
        self.assertEqual(doc["layers"], 3)
        self.assertTrue(doc["ok"])

    def test_rows_above_the_check_limit_are_unchecked_and_say_so(self):
        result = self.bench("-n", "2", "-t", "2,40", "--tiers", "overlap", "--iters", "1", "--check-max-tokens", "8")
        rows = [line.split() for line in result.stdout.splitlines() if line.strip().startswith(("2 ", "40 "))]
        self.assertEqual(len(rows), 2, result.stdout)
        self.assertEqual(rows[0][-1], "0")
        self.assertEqual(rows[1][-1], "-")
        self.assertIn("1 row(s) not checked: T > --check-max-tokens 8", result.stdout)

    def test_a_wrong_element_makes_bench_fail(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "bench.json")
            result = self.bench("-n", "2", "-t", "4", "--tiers", "column", "--iters", "1", "--json", path,
                                env={"LMOE_BENCH_INJECT_FAULT": "1"}, check=False)
            self.assertNotEqual(result.returncode, 0, result.stdout)
            self.assertIn("SOME ROWS FAILED", result.stdout)
            with open(path) as f:
                doc = json.load(f)
        self.assertFalse(doc["ok"])
        self.assertTrue(doc["fault_injected"])
        (record,) = doc["records"]
        self.assertGreaterEqual(record["wrong"], 1)
        self.assertFalse(record["ok"])

    def test_bad_options_name_themselves(self):
        cases = [
            (["-n", "0"], "-n/--ranks: expected at least 1 rank, got 0"),
            (["--tiers", "fused,warp"], "--tiers: unknown tier 'warp'"),
            (["--comm", "carrier-pigeon"], "--comm: unknown or unavailable comm backend 'carrier-pigeon'"),
            (["-t", "0"], "-t/--tokens: expected token counts >= 1, got 0"),
            (["--iters", "0"], "--iters: expected at least 1 timed iteration, got 0"),
            (["--warmup", "-1"], "--warmup: expected >= 0"),
            (["--check-max-tokens", "-5"], "--check-max-tokens: expected >= 0, got -5"),
            (["--mode", "lazy"], "--mode: unknown bench mode 'lazy'"),
            (["--mode", "device-tokens"], "mode device-tokens needs the cuda backend"),
            (["--cold-l2"], "cold_l2 (--cold-l2) needs the cuda backend: the cpu backend has no device L2 to evict"),
            (["--layers", "0"], "bench: layers (--layers): expected 1 to 64 tails a timed iteration, got 0"),
        ]
        for args, needle in cases:
            with self.subTest(args=args):
                result = self.bench("-n", "2", "-t", "1", *args, check=False) if args[0] != "-n" else self.bench(
                    *args, check=False)
                self.assertNotEqual(result.returncode, 0)
                self.assertIn(needle, result.stderr)
        result = self.bench("-n", "2", "-t", "1", env={"LMOE_BENCH_INJECT_FAULT": "yes"}, check=False)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("LMOE_BENCH_INJECT_FAULT='yes'", result.stderr)

    def test_help_defines_the_columns(self):
        result = lmoe("bench", "--help")
        for needle in ["busbw", "algbw", "#wrong", "LMOE_BENCH_INJECT_FAULT", "--check-max-tokens", "--comm"]:
            self.assertIn(needle, result.stdout)


def preferred_tier(tokens, breakpoints):
    """The policy's preference (include/lmoe/tier_policy.hpp), written again to check tables."""
    if tokens <= breakpoints["fused_max_tokens"]:
        return "fused"
    if tokens <= breakpoints["overlap_max_tokens"]:
        return "overlap"
    column = breakpoints["column_max_tokens"]
    return "column" if column is None or tokens <= column else "token"


TIERS = ["fused", "overlap", "column", "token"]
FALLBACKS = {"fused": ["overlap", "column", "token"], "overlap": ["column", "token", "fused"],
             "column": ["token", "overlap", "fused"], "token": ["column", "overlap", "fused"]}
NO_LIMIT = 2**63 - 1


def ranges_tier(tokens, ranges):
    """The ranges' preference: the first piece whose max_tokens holds T (null: no upper end)."""
    return next(piece["tier"] for piece in ranges if piece["max_tokens"] is None or tokens <= piece["max_tokens"])


def decided_tier(tokens, breakpoints, ran, ranges=None):
    first = ranges_tier(tokens, ranges) if ranges else preferred_tier(tokens, breakpoints)
    return next((tier for tier in [first] + FALLBACKS[first] if tier in ran), None)


def grid_regret(grid, breakpoints, ranges=None):
    """Per point: median(chosen) / median(fastest) - 1."""
    regrets = []
    for point in grid:
        ran = {tier: t["median_us"] for tier, t in point["tiers"].items() if "median_us" in t}
        chosen = decided_tier(point["tokens"], breakpoints, ran, ranges)
        regrets.append(ran[chosen] / min(ran.values()) - 1 if chosen else 0.0)
    return regrets


class TuneCommand(unittest.TestCase):
    """`lmoe tune` on the cpu backend at small dims, the table it writes, and how the other commands
    load it. Nothing here depends on which tier is faster: the checks are against the table's own
    measurements."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        cls.table = os.path.join(cls.dir.name, "tiers.json")
        cls.result = lmoe("tune", "--backend", "cpu", "--preset", "small", "-n", "2", "-t", "1,4,16,64",
                          "--warmup", "0", "--iters", "3", "--output", cls.table)
        with open(cls.table) as f:
            cls.doc = json.load(f)

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def edited_table(self, name, edit):
        doc = json.loads(json.dumps(self.doc))
        edit(doc)
        path = os.path.join(self.dir.name, name)
        with open(path, "w") as f:
            json.dump(doc, f)
        return path

    def test_a_table_tuned_with_layers_records_them_and_a_sweep_without_warns(self):
        table = os.path.join(self.dir.name, "layers.json")
        result = lmoe("tune", "--backend", "cpu", "--preset", "small", "-n", "2", "-t", "1,4", "--warmup", "0",
                      "--iters", "2", "--layers", "2", "--output", table)
        self.assertIn("2 timed iterations of 2 tails (layers, each its own weights; times per tail)", result.stdout)
        with open(table) as f:
            self.assertEqual(json.load(f)["provenance"]["layers"], 2)
        result = lmoe("bench", "--backend", "cpu", "--preset", "small", "-n", "2", "-t", "1,4", "--warmup", "0",
                      "--iters", "2", "--check-table", table, check=False)
        self.assertIn(f"tier table {table}: layers is 2 in the table, 1 here", result.stderr)

    def test_table_has_provenance_grid_and_breakpoints(self):
        doc = self.doc
        self.assertEqual((doc["format"], doc["version"]), ("lmoe-tier-table", 3))
        p = doc["provenance"]
        self.assertEqual((p["backend"], p["tp"], p["dtype"], p["comm"], p["preset"]), ("cpu", 2, "bf16", "threads", "small"))
        self.assertEqual(p["dims"], {"d_model": 384, "d_latent": 192})
        self.assertIsNone(p["gpu"])
        self.assertIsNone(p["nccl_version"])
        self.assertEqual((p["warmup"], p["iters"], p["mode"], p["cold_l2"], p["layers"]), (0, 3, "eager", False, 1))
        for field in ["lmoe_version", "date", "hostname", "driver_version"]:
            self.assertIn(field, p)
        self.assertEqual([point["tokens"] for point in doc["grid"]], [1, 4, 16, 64])
        self.assertIn("T=1 < tp=2", doc["grid"][0]["tiers"]["token"]["declined"])
        for point in doc["grid"]:
            for tier, timing in point["tiers"].items():
                if "median_us" in timing:
                    self.assertLessEqual(timing["p10_us"], timing["median_us"])
                    self.assertLessEqual(timing["median_us"], timing["p90_us"])
        self.assertEqual(set(doc["breakpoints"]), {"fused_max_tokens", "overlap_max_tokens", "column_max_tokens"})
        self.assertIsNone(doc["ranges"][-1]["max_tokens"])
        # The printed grid, the ranges and the breakpoints; progress on stderr.
        self.assertIn("ranges: ", self.result.stdout)
        self.assertIn("breakpoints: fused_max_tokens", self.result.stdout)
        self.assertIn("regret", self.result.stdout)
        self.assertIn("lmoe tune: [time", self.result.stderr)

    def test_ranges_give_every_t_its_fastest_tier(self):
        grid, ranges = self.doc["grid"], self.doc["ranges"]
        regrets = grid_regret(grid, None, ranges)
        for point, regret in zip(grid, regrets):
            ran = {tier: t["median_us"] for tier, t in point["tiers"].items() if "median_us" in t}
            self.assertEqual(point["chosen"], decided_tier(point["tokens"], None, ran, ranges))
            self.assertEqual(point["chosen"], min(ran, key=lambda tier: (ran[tier], TIERS.index(tier))))
            self.assertEqual(regret, 0.0)
            self.assertEqual(point["regret"], 0.0)
        self.assertEqual(self.doc["fit"]["total_regret"], 0.0)
        # Boundaries: where the tiers cross between the neighbours whose tiers differ; equal ones merged.
        tokens = [point["tokens"] for point in grid]
        medians = {point["tokens"]: {tier: t["median_us"] for tier, t in point["tiers"].items() if "median_us" in t}
                   for point in grid}
        for piece, following in zip(ranges, ranges[1:]):
            self.assertNotEqual(piece["tier"], following["tier"])
            upper = next(t for t in tokens if t > piece["max_tokens"])
            lower = tokens[tokens.index(upper) - 1]
            self.assertEqual(piece["max_tokens"],
                             range_boundary(lower, upper, medians[lower], medians[upper], piece["tier"],
                                            following["tier"]))
        described = ", ".join(p["tier"] + (f" T<={p['max_tokens']}" if p["max_tokens"] is not None else " above")
                              for p in ranges) if len(ranges) > 1 else ranges[0]["tier"] + " for every T"
        self.assertIn(f"ranges: {described} (regret: total 0.0%", self.result.stdout)

    def test_breakpoints_have_the_least_regret_the_policy_can_express(self):
        grid, breakpoints = self.doc["grid"], self.doc["breakpoints"]
        regrets = grid_regret(grid, breakpoints)
        for point, regret in zip(grid, regrets):
            ran = {tier for tier, t in point["tiers"].items() if "median_us" in t}
            self.assertEqual(point["breakpoints_chosen"], decided_tier(point["tokens"], breakpoints, ran))
            self.assertAlmostEqual(point["breakpoints_regret"], regret, places=5)
        self.assertAlmostEqual(self.doc["fit"]["breakpoints"]["total_regret"], sum(regrets), places=5)
        # Brute force over every assignment the breakpoints can express on this grid.
        limits = [0, NO_LIMIT] + [point["tokens"] for point in grid]
        least = min(
            sum(grid_regret(grid, {"fused_max_tokens": f, "overlap_max_tokens": o, "column_max_tokens": c}))
            for f in limits for o in limits for c in limits + [None])
        self.assertAlmostEqual(sum(regrets), least, places=9)

    def test_a_version_2_table_still_loads_and_its_breakpoints_rule(self):
        def to_version_2(doc):
            doc["version"] = 2
            del doc["ranges"]
        path = self.edited_table("v2.json", to_version_2)
        result = lmoe("explain", "--backend", "cpu", "--preset", "small", "--tp", "2", "-t", "50", "--tier-table", path)
        self.assertIn("rule: breakpoints\n", result.stdout)
        ran = {"fused", "overlap", "column", "token"}
        self.assertIn(f"decision: T=50 → {decided_tier(50, self.doc['breakpoints'], ran)} ", result.stdout)

    def test_explain_cites_the_table(self):
        result = lmoe("explain", "--backend", "cpu", "--preset", "small", "--tp", "2", "-t", "50", "--comm", "threads",
                      "--tier-table", self.table)
        self.assertIn(f"evidence: table {self.table} measured at T=64 (nearest to T=50):", result.stdout)
        self.assertIn("(chosen)", result.stdout)
        self.assertIn(f"table {self.table} fused_max_tokens", result.stdout)
        self.assertIn("on cpu, tp 2, comm threads", result.stdout)
        self.assertIn("rule: ranges ", result.stdout)
        self.assertIn(f" (table {self.table} ranges); the breakpoints are not used", result.stdout)
        ran = {"fused", "overlap", "column", "token"}
        self.assertIn(f"decision: T=50 → {decided_tier(50, None, ran, self.doc['ranges'])} (preferred: ", result.stdout)

    def test_a_table_for_other_dims_or_tp_is_refused(self):
        cases = [
            (["explain", "--backend", "cpu", "--preset", "small", "--tp", "4", "-t", "8"], "tp is 2 in the table, 4 here"),
            (["explain", "--backend", "cpu", "--preset", "kimi-k3", "--tp", "2", "-t", "8"],
             "d_model is 384 in the table, 7168 here; d_latent is 192 in the table, 3584 here"),
            (["explain", "--backend", "cpu", "--preset", "small", "--tp", "2", "-t", "8", "--dtype", "f32"],
             "dtype is bf16 in the table, f32 here"),
            (["run", "--backend", "cpu", "--preset", "small", "-n", "3", "-t", "1"], "tp is 2 in the table, 3 here"),
            (["bench", "--backend", "cpu", "--preset", "small", "-n", "4", "-t", "1", "--iters", "1"], "tp is 2 in the table, 4 here"),
        ]
        for args, needle in cases:
            for how in ["flag", "env"]:
                with self.subTest(args=args, how=how):
                    if how == "flag":
                        result = lmoe(*args, "--tier-table", self.table, check=False)
                    else:
                        result = lmoe(*args, env={"LMOE_TIER_TABLE": self.table}, check=False)
                    self.assertEqual(result.returncode, 2, result.stdout + result.stderr)
                    self.assertIn(f"tier table {self.table} was measured for another configuration", result.stderr)
                    self.assertIn(needle, result.stderr)
        # Another GPU: the table claims one; this run has none (the cpu backend), so the backend differs.
        on_gpu = self.edited_table("gpu.json", lambda d: d["provenance"].update(
            backend="cuda", gpu={"name": "NVIDIA H200", "compute_capability": "9.0",
                                 "cuda_driver_version": 13000, "cuda_runtime_version": 13000}))
        result = lmoe("explain", "--backend", "cpu", "--preset", "small", "--tp", "2", "-t", "8", "--tier-table", on_gpu,
                      check=False)
        self.assertEqual(result.returncode, 2)
        self.assertIn("backend is cuda in the table, cpu here", result.stderr)

    def test_another_lmoe_version_only_warns(self):
        path = self.edited_table("old.json", lambda d: d["provenance"].update(lmoe_version="0.0.1"))
        result = lmoe("explain", "--backend", "cpu", "--preset", "small", "--tp", "2", "-t", "8", "--tier-table", path)
        self.assertIn(f"lmoe: warning: tier table {path}: lmoe_version is '0.0.1' in the table", result.stderr)
        self.assertIn("decision: T=8", result.stdout)

    def test_environment_overrides_the_table_and_the_flag_overrides_the_variable(self):
        result = lmoe("explain", "--backend", "cpu", "--preset", "small", "--tp", "2", "-t", "8",
                      env={"LMOE_TIER_TABLE": self.table, "LMOE_FUSED_MAX_TOKENS": "3"})
        self.assertIn("fused_max_tokens    3       LMOE_FUSED_MAX_TOKENS=3", result.stdout)
        self.assertIn(f"table {self.table} overlap_max_tokens", result.stdout)
        # A breakpoint variable sets the table's ranges aside, and explain says so.
        self.assertIn("rule: breakpoints; the table's ranges are set aside because LMOE_FUSED_MAX_TOKENS=3 is set",
                      result.stdout)
        ran = {"fused", "overlap", "column", "token"}
        breakpoints = dict(self.doc["breakpoints"], fused_max_tokens=3)
        self.assertIn(f"decision: T=8 → {decided_tier(8, breakpoints, ran)} ", result.stdout)
        # --tier-table wins over LMOE_TIER_TABLE (which names a file that does not exist).
        result = lmoe("explain", "--backend", "cpu", "--preset", "small", "--tp", "2", "-t", "8", "--tier-table", self.table,
                      env={"LMOE_TIER_TABLE": os.path.join(self.dir.name, "missing.json")})
        self.assertIn(f"tier_table          {self.table}", result.stdout)

    def test_run_uses_the_table(self):
        result = lmoe("run", "--backend", "cpu", "--preset", "small", "-n", "2", "-t", "1,64", "--tier-table", self.table)
        self.assertIn("all rows ok", result.stdout)
        chosen = {int(line.split()[0]): line.split()[1] for line in result.stdout.splitlines()
                  if line.strip() and line.split()[0] in ("1", "64")}
        self.assertEqual(set(chosen), {1, 64}, result.stdout)
        for point in self.doc["grid"]:
            if point["tokens"] in chosen:
                self.assertEqual(chosen[point["tokens"]], point["chosen"], result.stdout)

    def test_tail_uses_a_fitting_table_and_refuses_another(self):
        for d, l, ok in [(384, 192, True), (32, 16, False)]:
            with self.subTest(d=d, l=l):
                routed, shared, gamma, w_up = make_case(2, 16, d, l, seed=5)
                path = os.path.join(self.dir.name, f"case_{d}.safetensors")
                write_safetensors(path, {
                    "routed": ("BF16", routed.shape, routed.tobytes()),
                    "shared": ("BF16", shared.shape, shared.tobytes()),
                    "norm.weight": ("BF16", gamma.shape, gamma.tobytes()),
                    "up_proj.weight": ("BF16", w_up.shape, w_up.tobytes()),
                })
                out = os.path.join(self.dir.name, f"out_{d}.safetensors")
                result = lmoe("tail", "--input", path, "--output", out, "--backend", "cpu", "--tier-table", self.table,
                              check=False)
                if ok:
                    self.assertEqual(result.returncode, 0, result.stderr)
                    chosen = next(p["chosen"] for p in self.doc["grid"] if p["tokens"] == 16)
                    self.assertIn(f"tier: {chosen}", result.stdout)
                    self.assertIn(f"evidence: table {self.table} measured at T=16:", result.stderr)
                else:
                    self.assertEqual(result.returncode, 2)
                    self.assertIn("d_model is 384 in the table, 32 here", result.stderr)
                    self.assertFalse(os.path.exists(out))

    def test_check_table_judges_every_choice_by_the_rule(self):
        path = os.path.join(self.dir.name, "check.json")
        result = lmoe("bench", "--backend", "cpu", "--preset", "small", "-n", "2", "--warmup", "0", "--iters", "3",
                      "--check-table", self.table, "--json", path, check=False)
        self.assertIn(result.returncode, (0, 1), result.stderr)
        self.assertIn("# policy check: tier table", result.stdout)
        self.assertIn("(rule: ranges ", result.stdout)  # the ranges are what is judged
        with open(path) as f:
            doc = json.load(f)
        self.assertEqual(doc["tier_table"], self.table)
        self.assertEqual(doc["tokens"], [1, 4, 16, 64])  # the table's grid by default
        self.assertEqual(doc["comms"], ["threads"])
        checks = doc["policy_check"]
        self.assertEqual([c["tokens"] for c in checks], [1, 4, 16, 64])
        # The verdicts follow the rule, recomputed here from the records.
        for check in checks:
            with self.subTest(tokens=check["tokens"]):
                ran = [r for r in doc["records"] if r["tokens"] == check["tokens"] and r["status"] == "ran"]
                fastest = min(ran, key=lambda r: r["median_us"])
                (chosen,) = [r for r in ran if r["chosen"]]
                self.assertEqual((check["chosen"], check["fastest"]), (chosen["tier"], fastest["tier"]))
                ok = chosen["median_us"] <= 1.03 * fastest["median_us"] or chosen["median_us"] <= fastest["p90_us"]
                self.assertEqual(check["ok"], ok)
        failed = not all(c["ok"] for c in checks)
        self.assertEqual(result.returncode == 1, failed or not all(r["ok"] for r in doc["records"]))
        self.assertEqual("POLICY CHECK FAILED" in result.stdout, failed)

    def test_bare_check_table_checks_the_loaded_table(self):
        path = os.path.join(self.dir.name, "bare.json")
        for args, env in [(["--tier-table", self.table, "--check-table"], None), (["--check-table"], {"LMOE_TIER_TABLE": self.table})]:
            with self.subTest(args=args):
                result = lmoe("bench", "--backend", "cpu", "--preset", "small", "-n", "2", "-t", "4", "--iters", "1",
                              "--json", path, *args, env=env, check=False)
                self.assertIn(result.returncode, (0, 1), result.stderr)
                self.assertIn(f"# policy check: tier table {self.table}", result.stdout)
                with open(path) as f:
                    doc = json.load(f)
                self.assertEqual(doc["tier_table"], self.table)
                self.assertEqual([c["tokens"] for c in doc["policy_check"]], [4])
        # Without any table the defaults are checked, and said to be.
        result = lmoe("bench", "--backend", "cpu", "--preset", "small", "-n", "2", "-t", "4", "--iters", "1",
                      "--check-table", check=False)
        self.assertIn(result.returncode, (0, 1), result.stderr)
        self.assertIn("# policy check: no tier table given (defaults and environment; a table built into lmoe where one holds)", result.stdout)

    def test_check_table_needs_every_tier_and_one_table(self):
        result = lmoe("bench", "--backend", "cpu", "--preset", "small", "-n", "2", "--tiers", "fused", "--check-table",
                      self.table, check=False)
        self.assertEqual(result.returncode, 2)
        self.assertIn("--check-table: compares the policy's choice with every tier", result.stderr)
        other = self.edited_table("other.json", lambda d: None)
        result = lmoe("bench", "--backend", "cpu", "--preset", "small", "-n", "2", "--check-table", self.table,
                      "--tier-table", other, check=False)
        self.assertEqual(result.returncode, 2)
        self.assertIn("name different tables", result.stderr)

    def test_tune_bad_options(self):
        cases = [
            (["--output", os.path.join(self.dir.name, "no", "such", "dir.json")], "--output: cannot write"),
            (["--output", "x.json", "-n", "0"], "-n/--ranks/--tp: expected at least 1 rank, got 0"),
            (["--output", "x.json", "--comm", "nccl"], "--comm nccl: not available for the cpu backend"),
            (["--output", "x.json", "-t", "0"], "-t/--tokens: expected token counts >= 1, got 0"),
            (["--output", "x.json", "--cold-l2"], "the cpu backend has no device L2 to evict"),
        ]
        for args, needle in cases:
            with self.subTest(args=args):
                result = lmoe("tune", "--backend", "cpu", *args, check=False)
                self.assertNotEqual(result.returncode, 0)
                self.assertIn(needle, result.stderr)
        self.assertFalse(os.path.exists("x.json"))
        result = lmoe("tune", "--help")
        for needle in ["--output", "--tp", "--comm", "--cold-l2", "docs/tuning.md"]:
            self.assertIn(needle, result.stdout)


def load_plot_script():
    import importlib.util
    path = os.path.join(ROOT, "scripts", "plot_bench.py")
    spec = importlib.util.spec_from_file_location("plot_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


def range_boundary(a, b, times_a, times_b, lower, upper):
    """Where a range boundary between grid T a < b goes (docs/tuning.md): where the lower and upper
    tiers' medians cross, interpolated linearly in T, when both ran at both points and each leads at
    its own end; else floor(sqrt(a*b)). times_a, times_b: {tier: median_us} at a and b."""
    if all(tier in times for tier in (lower, upper) for times in (times_a, times_b)):
        lead_lo, lead_hi = times_a[upper] - times_a[lower], times_b[lower] - times_b[upper]
        if lead_lo >= 0 and lead_hi >= 0 and lead_lo + lead_hi > 0:
            return min(max(math.floor(a + (b - a) * lead_lo / (lead_lo + lead_hi)), a), b - 1)
    return math.isqrt(a * b)


DATA_DIR = os.path.join(ROOT, "tests", "data")


def fitted_ranges(grid_tokens, fastest, medians):
    """The ranges find_ranges gives when every T's fastest tier can run: equal neighbours merged,
    boundaries where the tiers cross (range_boundary below; docs/tuning.md), written again here from
    the records. medians: {T: {tier: median_us}} of the tiers that ran."""
    ranges = [{"max_tokens": None, "tier": fastest[grid_tokens[0]]}]
    for a, b in zip(grid_tokens, grid_tokens[1:]):
        if fastest[b] != ranges[-1]["tier"]:
            ranges[-1]["max_tokens"] = range_boundary(a, b, medians[a], medians[b], ranges[-1]["tier"], fastest[b])
            ranges.append({"max_tokens": None, "tier": fastest[b]})
    return ranges


class RecordedSweeps(unittest.TestCase):
    """`lmoe tune --from-sweep` and `lmoe bench --check-table --from-sweep`: nothing measured, the
    records of a `lmoe bench --json` file used instead."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        cls.sweep = os.path.join(cls.dir.name, "sweep.json")
        # T=64 is above --check-max-tokens: its timings are used unchecked.
        lmoe("bench", "--backend", "cpu", "--preset", "small", "-n", "2", "-t", "1,4,16,64", "--warmup", "0",
             "--iters", "3", "--check-max-tokens", "16", "--json", cls.sweep)
        with open(cls.sweep) as f:
            cls.doc = json.load(f)
        cls.table = os.path.join(cls.dir.name, "derived.json")
        cls.tuned = lmoe("tune", "--from-sweep", cls.sweep, "-o", cls.table)
        with open(cls.table) as f:
            cls.table_doc = json.load(f)

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def path(self, name):
        return os.path.join(self.dir.name, name)

    def edited_sweep(self, name, edit):
        doc = json.loads(json.dumps(self.doc))
        edit(doc)
        path = self.path(name)
        with open(path, "w") as f:
            json.dump(doc, f)
        return path

    def test_the_table_is_fitted_on_the_records_and_says_where_they_come_from(self):
        doc, records = self.table_doc, self.doc["records"]
        self.assertEqual(doc["version"], 3)
        # Every tier's median, p10 and p90 are the records', to the nanosecond.
        for point in doc["grid"]:
            for tier, timing in point["tiers"].items():
                (record,) = [r for r in records if (r["tokens"], r["tier"]) == (point["tokens"], tier)]
                if record["status"] == "declined":
                    self.assertEqual(timing["declined"], record["reason"])
                    continue
                for key in ["median_us", "p10_us", "p90_us"]:
                    self.assertAlmostEqual(timing[key], record[key], places=3)
        # The ranges, recomputed from the records.
        fastest, medians = {}, {}
        for t in [1, 4, 16, 64]:
            ran = [r for r in records if r["tokens"] == t and r["status"] == "ran"]
            fastest[t] = min(ran, key=lambda r: (r["median_us"], TIERS.index(r["tier"])))["tier"]
            medians[t] = {r["tier"]: r["median_us"] for r in ran}
        self.assertEqual(doc["ranges"], fitted_ranges([1, 4, 16, 64], fastest, medians))
        self.assertEqual(doc["fit"]["total_regret"], 0.0)
        # The provenance is the sweep's, with where it was derived from.
        p, sweep = doc["provenance"], self.doc
        self.assertEqual((p["backend"], p["tp"], p["dtype"], p["comm"], p["preset"], p["mode"]),
                         ("cpu", 2, "bf16", "threads", "small", "eager"))
        self.assertEqual(p["dims"], {"d_model": 384, "d_latent": 192})
        self.assertEqual((p["date"], p["hostname"], p["warmup"], p["iters"], p["lmoe_version"]),
                         (sweep["date"], sweep["hostname"], 0, 3, sweep["version"]))
        self.assertAlmostEqual(p["eps"], sweep["eps"])
        self.assertEqual((p["cold_l2"], sweep["cold_l2"]), (False, False))
        self.assertEqual((p["derived_from"]["path"], p["derived_from"]["date"]), (self.sweep, sweep["date"]))
        self.assertRegex(p["derived_from"]["derived_date"], r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
        # The printed table is `lmoe tune`'s, and says what was not checked.
        out = self.tuned.stdout
        self.assertIn(f"from the sweep recorded in {self.sweep} ({sweep['date']}", out)
        self.assertIn("ranges: ", out)
        self.assertIn("breakpoints: fused_max_tokens", out)
        self.assertIn("# 4 timing(s) above T=16 were not checked against the numerics contract", out)
        self.assertNotIn("[time", self.tuned.stderr)  # nothing measured, no progress

    def test_the_derived_table_loads_and_is_refused_like_a_measured_one(self):
        result = lmoe("explain", "--backend", "cpu", "--preset", "small", "--tp", "2", "-t", "50", "--comm", "threads",
                      "--tier-table", self.table)
        self.assertIn(f"evidence: table {self.table} measured at T=64 (nearest to T=50):", result.stdout)
        self.assertIn("rule: ranges ", result.stdout)
        for args, needle in [(["explain", "--tp", "4", "-t", "8"], "tp is 2 in the table, 4 here"),
                             (["run", "-n", "2", "-t", "1", "--dtype", "f32"], "dtype is bf16 in the table, f32 here")]:
            with self.subTest(args=args):
                result = lmoe(args[0], "--backend", "cpu", "--preset", "small", *args[1:], "--tier-table", self.table,
                              check=False)
                self.assertEqual(result.returncode, 2, result.stdout)
                self.assertIn(f"tier table {self.table} was measured for another configuration", result.stderr)
                self.assertIn(needle, result.stderr)

    def test_refit_fits_a_tables_own_grid_again(self):
        # A table whose ranges and breakpoints say something else than its grid: --refit puts back what
        # the grid gives, and keeps the grid and the provenance.
        doc = json.loads(json.dumps(self.table_doc))
        doc["ranges"] = [{"max_tokens": None, "tier": "token"}]
        doc["breakpoints"] = {"fused_max_tokens": 0, "overlap_max_tokens": 0, "column_max_tokens": 0}
        edited, out = self.path("stale.json"), self.path("refit.json")
        with open(edited, "w") as f:
            json.dump(doc, f)
        result = lmoe("tune", "--refit", edited, "-o", out)
        self.assertIn(f"fitted again from the grid of {edited} (measured ", result.stdout)
        self.assertIn("nothing measured here", result.stdout)
        with open(out) as f:
            refit = json.load(f)
        for key in ("ranges", "breakpoints", "grid", "provenance", "fit"):
            self.assertEqual(refit[key], self.table_doc[key], key)

    def test_options_that_shape_a_measurement_are_refused(self):
        out = self.path("never.json")
        cases = [
            (["tune", "--from-sweep", self.sweep, "-o", out, "-t", "1,2", "--iters", "3"],
             "--from-sweep: -t/--tokens, --iters shape a measurement; with --from-sweep the configuration"),
            (["tune", "--from-sweep", self.sweep, "-o", out, "--tp", "2"], "--from-sweep: -n/--ranks/--tp shapes a measurement"),
            (["tune", "--from-sweep", self.sweep, "-o", out, "--backend", "cpu", "--preset", "small"],
             "--from-sweep: --preset, --backend shape"),
            (["tune", "--from-sweep", self.sweep, "-o", out, "--check-max-tokens", "4"],
             "--from-sweep: --check-max-tokens shapes a measurement"),
            (["tune", "--from-sweep", self.sweep, "-o", out, "--mode", "eager", "--seed", "3", "--warmup", "1"],
             "--from-sweep: --warmup, --mode, --seed shape"),
            (["tune", "--from-sweep", self.sweep, "-o", out, "--cold-l2"], "--from-sweep: --cold-l2 shapes a measurement"),
            (["tune", "--from-sweep", self.sweep, "-o", out, "--layers", "2"], "--from-sweep: --layers shapes a measurement"),
            (["bench", "--check-table", self.table, "--from-sweep", self.sweep, "--tiers", "column"],
             "--from-sweep: --tiers shapes a measurement"),
            (["bench", "--check-table", self.table, "--from-sweep", self.sweep, "-n", "2", "--no-check"],
             "--from-sweep: -n/--ranks, --no-check shape"),
            (["bench", "--check-table", self.table, "--from-sweep", self.sweep, "--layers", "4"],
             "--from-sweep: --layers shapes a measurement"),
            (["bench", "--from-sweep", self.sweep], "--from-sweep: needs --check-table"),
            (["tune", "--from-sweep", self.table, "-o", out], f"{self.table}: is a tier table, not a recorded sweep"),
            (["tune", "--from-sweep", self.path("missing.json"), "-o", out], "cannot read the sweep file"),
            (["tune", "--refit", self.table, "-o", out, "-t", "1,2", "--comm", "threads"],
             "--refit: -t/--tokens, --comm shape a measurement; with --refit the configuration, grid and iterations "
             "are the table's"),
            (["tune", "--refit", self.table, "--from-sweep", self.sweep, "-o", out], "--refit and --from-sweep: give one"),
            (["tune", "--refit", self.sweep, "-o", out],
             f"{self.sweep}: is a recorded sweep of `lmoe bench --json`, not a tier table"),
            (["tune", "--refit", self.path("missing.json"), "-o", out], "cannot read the tier table file"),
        ]
        for args, needle in cases:
            with self.subTest(args=args):
                result = lmoe(*args, check=False)
                self.assertEqual(result.returncode, 2, result.stdout + result.stderr)
                self.assertIn(needle, result.stderr)
        self.assertFalse(os.path.exists(out))

    def test_a_wrong_row_is_refused_and_named(self):
        def make_wrong(doc):
            (record,) = [r for r in doc["records"] if (r["tokens"], r["tier"]) == (4, "column")]
            record["wrong"], record["ok"] = 2, False
        path = self.edited_sweep("wrong.json", make_wrong)
        index = next(i for i, r in enumerate(self.doc["records"]) if (r["tokens"], r["tier"]) == (4, "column"))
        out = self.path("wrong_table.json")
        result = lmoe("tune", "--from-sweep", path, "-o", out, check=False)
        self.assertEqual(result.returncode, 2, result.stdout)
        self.assertIn(f"{path}: comm threads: records[{index}] (T=4 column): 2 element(s) beyond the numerics "
                      "contract", result.stderr)
        self.assertFalse(os.path.exists(out))
        # Checked against, the wrong row fails the run as it failed the sweep.
        result = lmoe("bench", "--check-table", self.table, "--from-sweep", path, check=False)
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertIn("SOME ROWS FAILED (1 row(s), 0 comm error(s))", result.stdout)
        # A record whose "ok" contradicts its fields is refused as garbled.
        path = self.edited_sweep("garbled.json", lambda d: d["records"][index].update(wrong=2))
        result = lmoe("tune", "--from-sweep", path, "-o", out, check=False)
        self.assertEqual(result.returncode, 2)
        self.assertIn(f"records[{index}].ok: the record says true but its fields say false", result.stderr)
        path = self.edited_sweep("missing_field.json", lambda d: d["records"][index].pop("median_us"))
        result = lmoe("tune", "--from-sweep", path, "-o", out, check=False)
        self.assertEqual(result.returncode, 2)
        self.assertIn(f"{path}: records[{index}]: missing \"median_us\"", result.stderr)

    def two_comm_sweep(self):
        def add_p2p(doc):
            doc["comms"].append("p2p")
            doc["records"] += [dict(r, comm="p2p") for r in doc["records"]]
        return self.edited_sweep("two_comms.json", add_p2p)

    def test_several_comms_need_one_named(self):
        path = self.two_comm_sweep()
        out = self.path("p2p_table.json")
        result = lmoe("tune", "--from-sweep", path, "-o", out, check=False)
        self.assertEqual(result.returncode, 2)
        self.assertIn(f"{path}: the sweep has records of several comms (threads, p2p); say which with --comm",
                      result.stderr)
        lmoe("tune", "--from-sweep", path, "--comm", "p2p", "-o", out)
        with open(out) as f:
            self.assertEqual(json.load(f)["provenance"]["comm"], "p2p")
        result = lmoe("tune", "--from-sweep", path, "--comm", "nccl", "-o", out, check=False)
        self.assertEqual(result.returncode, 2)
        self.assertIn("no records of comm 'nccl' (the sweep has threads, p2p)", result.stderr)
        # The check takes the table's comm from a sweep of several.
        result = lmoe("bench", "--check-table", self.table, "--from-sweep", path, check=False)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertNotIn(" p2p ", result.stdout)

    def test_check_table_from_a_sweep_passes_and_fails_by_the_rule(self):
        # Against the very records it was fitted on, every choice is the fastest.
        out = self.path("check.json")
        result = lmoe("bench", "--check-table", self.table, "--from-sweep", self.sweep, "--json", out)
        self.assertIn(f"# policy check: tier table {self.table} against the sweep recorded in {self.sweep}", result.stdout)
        self.assertIn("policy check ok (4 choice(s) judged)", result.stdout)
        self.assertIn("nothing measured here", result.stdout)
        with open(out) as f:
            doc = json.load(f)
        self.assertEqual((doc["from_sweep"], doc["tier_table"], doc["ok"]), (self.sweep, self.table, True))
        self.assertEqual([c["verdict"] for c in doc["policy_check"]], ["fastest"] * 4)
        self.assertEqual(doc["date"], self.doc["date"])  # the sweep's records, not a new measurement
        # The output reads again as a sweep: a table derived from it is the same.
        again = self.path("again.json")
        lmoe("tune", "--from-sweep", out, "-o", again)
        with open(again) as f:
            self.assertEqual(json.load(f)["ranges"], self.table_doc["ranges"])

        # Make the table's choice at T=4 ten times slower than the slowest run of any other tier
        # there: the check fails there and only there.
        chosen = next(p["chosen"] for p in self.table_doc["grid"] if p["tokens"] == 4)
        def slow_down(doc):
            at_4 = [r for r in doc["records"] if r["tokens"] == 4 and r["status"] == "ran"]
            slow = 10 * max(r["max_us"] for r in at_4 if r["tier"] != chosen)
            (r,) = [r for r in at_4 if r["tier"] == chosen]
            for key in ["median_us", "p10_us", "p90_us", "min_us", "max_us"]:
                r[key] = slow
            r["iterations_us"] = [slow] * len(r["iterations_us"])
        path = self.edited_sweep("slower.json", slow_down)
        result = lmoe("bench", "--check-table", self.table, "--from-sweep", path, "--json", out, check=False)
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertIn("POLICY CHECK FAILED (1 of 4 choice(s) slower than the rule allows)", result.stdout)
        with open(out) as f:
            checks = json.load(f)["policy_check"]
        self.assertEqual([c["tokens"] for c in checks if not c["ok"]], [4])
        self.assertEqual(next(c for c in checks if c["tokens"] == 4)["verdict"], "SLOWER")

    def test_a_cold_sweep_says_so_and_gives_a_cold_table(self):
        # A sweep recorded with --cold-l2 (on a GPU; here the flag of a cpu recording is set by hand).
        path = self.edited_sweep("cold.json", lambda d: d.update(cold_l2=True))
        table = self.path("cold_table.json")
        result = lmoe("tune", "--from-sweep", path, "-o", table)
        self.assertIn("0 warm-up + 3 timed iterations, L2 evicted before each", result.stderr)
        with open(table) as f:
            self.assertIs(json.load(f)["provenance"]["cold_l2"], True)
        result = lmoe("bench", "--check-table", table, "--from-sweep", path)
        self.assertIn("0 warm-up + 3 timed iterations, L2 evicted before each", result.stderr)
        self.assertNotIn("cold_l2 is", result.stderr)
        self.assertNotIn("L2 evicted", self.tuned.stderr)  # the warm sweep's table
        # A cold table judged on a warm sweep, and a warm one on a cold sweep: judged, with a warning.
        for table_path, sweep_path, needle in [
            (table, self.sweep, "cold_l2 is true in the table, false here; the table is used"),
            (self.table, path, "cold_l2 is false in the table, true here; the table is used"),
        ]:
            with self.subTest(table=table_path):
                result = lmoe("bench", "--check-table", table_path, "--from-sweep", sweep_path,
                              check=False)
                self.assertIn(needle, result.stderr)

    def test_a_sweep_of_another_configuration_is_refused_by_field(self):
        for name, edit, needle in [
            ("tp4.json", lambda d: d.update(tp=4), "tp is 2 in the table, 4 here"),
            ("dims.json", lambda d: d.update(d_model=512), "d_model is 384 in the table, 512 here"),
            ("gpu.json", lambda d: d.update(backend="cuda"), "backend is cpu in the table, cuda here"),
        ]:
            with self.subTest(name=name):
                path = self.edited_sweep(name, edit)
                result = lmoe("bench", "--check-table", self.table, "--from-sweep", path, check=False)
                self.assertEqual(result.returncode, 2, result.stdout)
                self.assertIn(f"tier table {self.table} was measured for another configuration", result.stderr)
                self.assertIn(needle, result.stderr)
        path = self.edited_sweep("other_comm.json", lambda d: (d.update(comms=["p2p"]),
                                                              [r.update(comm="p2p") for r in d["records"]]))
        result = lmoe("bench", "--check-table", self.table, "--from-sweep", path, check=False)
        self.assertEqual(result.returncode, 2)
        self.assertIn(f"{path}: no records of comm 'threads' (the sweep has p2p)", result.stderr)

    def test_the_h200_recordings(self):
        bench, check = os.path.join(DATA_DIR, "bench_k3_tp2.json"), os.path.join(DATA_DIR, "check_k3_tp2.json")
        table = self.path("tiers_k3_tp2_v3.json")
        result = lmoe("tune", "--from-sweep", bench, "--comm", "nccl", "-o", table)
        self.assertIn("ranges: column T<=76, overlap T<=648, token above (regret: total 0.0% over 8 T", result.stdout)
        self.assertIn("(NVIDIA H200, cc 9.0), from the sweep recorded in", result.stdout)
        with open(table) as f:
            p = json.load(f)["provenance"]
        self.assertEqual((p["gpu"]["name"], p["nccl_version"], p["tp"], p["comm"], p["iters"]),
                         ("NVIDIA H200", "2.28.3", 2, "nccl", 50))
        # Checked against the second sweep of that session: every choice is the fastest.
        result = lmoe("bench", "--check-table", table, "--from-sweep", check)
        self.assertIn("policy check ok (7 choice(s) judged)", result.stdout)
        self.assertEqual(result.stdout.count(" fastest\n"), 7)
        # The table `lmoe tune` wrote in that session (version 2, breakpoints) fails the same check,
        # with the verdicts the GPU machine recorded.
        old = os.path.join(DATA_DIR, "tiers_k3_tp2.json")
        out = self.path("old_check.json")
        result = lmoe("bench", "--check-table", old, "--from-sweep", check, "--json", out, check=False)
        self.assertEqual(result.returncode, 1, result.stderr)
        self.assertIn("POLICY CHECK FAILED (1 of 7 choice(s) slower than the rule allows)", result.stdout)
        self.assertIn("driver_version is '580.159.04' in the table, none here", result.stderr)
        with open(out) as f:
            judged = json.load(f)["policy_check"]
        with open(check) as f:
            recorded = json.load(f)["policy_check"]
        self.assertEqual([(c["tokens"], c["chosen"], c["verdict"]) for c in judged],
                         [(c["tokens"], c["chosen"], c["verdict"]) for c in recorded])

    def test_floors_of_the_h200_recordings(self):
        # Floors from the rates lmoe knows for the recorded GPU: one rank per GPU (nccl, p2p) gets
        # them, ranks sharing one GPU (cuda-threads) and declined rows do not.
        out = self.path("floors.json")
        result = lmoe("bench", "--check-table", "--from-sweep", os.path.join(DATA_DIR, "bench_k3_tp2.json"),
                      "--json", out, check=False)
        self.assertIn("# rates: link 450 GB/s, memory 4270 GB/s, GEMM 790 TFLOP/s (known for NVIDIA H200 bf16)",
                      result.stdout)
        with open(out) as f:
            doc = json.load(f)
        self.assertEqual(doc["floor_rates"], {"link_gbps": 450.0, "memory_gbps": 4270.0, "gemm_tflops": 790.0,
                                              "source": "known for NVIDIA H200 bf16"})
        self.assertIn("floor", doc["definitions"])
        for r in doc["records"]:
            with self.subTest(comm=r["comm"], tier=r["tier"], tokens=r["tokens"]):
                if r["status"] == "declined" or r["comm"] == "cuda-threads":
                    self.assertIsNone(r["floor"])
                    continue
                f = r["floor"]
                self.assertEqual(f["floor_us"], max(f["comm_us"], f["memory_us"], f["flops_us"]))
                self.assertAlmostEqual(f["comm_us"], r["bus_bytes"] / 450e3, places=9)
                self.assertGreater(r["median_us"], f["floor_us"])
        # K3 at tp 2, T = 1: column reads its stripe (half of w_up's 51.4 MB) and its inputs.
        (column,) = [r for r in doc["records"] if (r["comm"], r["tier"], r["tokens"]) == ("nccl", "column", 1)]
        stripe, inputs = 3584 * 3584 * 2, (3584 + 2 * 7168) * 2
        self.assertAlmostEqual(column["floor"]["memory_us"], (stripe + inputs) / 4270e3, places=9)
        row = [line for line in result.stdout.splitlines() if line.split()[:4] == ["1", "21504", "column", "nccl"]]
        self.assertEqual(row[0].split()[10:12], ["6.0", f"{column['median_us'] / column['floor']['floor_us']:.1f}"])

    def test_rates_are_given_or_refused_before_anything_is_measured(self):
        out = self.path("rates.json")
        result = lmoe("bench", "--backend", "cpu", "--preset", "small", "-n", "1", "-t", "4", "--iters", "1",
                      "--warmup", "0", "--tiers", "overlap", "--rates", "100,200,1", "--json", out)
        self.assertIn("# rates: link 100 GB/s, memory 200 GB/s, GEMM 1 TFLOP/s (--rates)", result.stdout)
        with open(out) as f:
            (record,) = json.load(f)["records"]
        # d = 384, l = 192, T = 4, bf16: 2·4·192·384 FLOPs at 1 TFLOP/s; (384·192 + 4·(192 + 768))·2
        # bytes at 200 GB/s; one rank sends nothing.
        self.assertAlmostEqual(record["floor"]["flops_us"], 2 * 4 * 192 * 384 / 1e6, places=9)
        self.assertAlmostEqual(record["floor"]["memory_us"], (384 * 192 + 4 * 960) * 2 / 200e3, places=9)
        self.assertEqual(record["floor"]["comm_us"], 0.0)
        # Without --rates the cpu backend has none: '-' in the table, null in the file.
        result = lmoe("bench", "--backend", "cpu", "--preset", "small", "-n", "1", "-t", "4", "--iters", "1",
                      "--warmup", "0", "--tiers", "overlap", "--json", out)
        self.assertIn("# rates: no rates known for the cpu backend (give --rates", result.stdout)
        with open(out) as f:
            doc = json.load(f)
        self.assertIsNone(doc["floor_rates"])
        self.assertIsNone(doc["records"][0]["floor"])
        for rates, needle in [("1,2", "expected three numbers LINK_GBS,MEMORY_GBS,GEMM_TFLOPS, got 2"),
                              ("1,x,3", "got 'x'"), ("1,0,3", "rates must be finite and > 0")]:
            with self.subTest(rates=rates):
                result = lmoe("bench", "--backend", "cpu", "--preset", "small", "-n", "1", "-t", "4",
                              "--rates", rates, check=False)
                self.assertEqual(result.returncode, 2, result.stdout)
                self.assertIn(needle, result.stderr)
                self.assertNotIn("[time", result.stderr)  # refused before the sweep


class PlotScript(unittest.TestCase):
    """scripts/plot_bench.py without matplotlib: its help and the data it would draw."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        cls.bench = os.path.join(cls.dir.name, "bench.json")
        lmoe("bench", "--backend", "cpu", "--preset", "small", "-n", "2", "-t", "1,8,64", "--iters", "2", "--json", cls.bench)
        with open(cls.bench) as f:
            cls.doc = json.load(f)
        cls.path, cls.plot = load_plot_script()

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def test_help_says_how_to_install_matplotlib(self):
        result = subprocess.run([sys.executable, self.path, "--help"], capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("pip install matplotlib", result.stdout)

    def test_bus_bytes_agree_with_lmoe(self):
        for r in self.doc["records"]:
            expected = self.plot.bus_bytes(r["tier"], r["tokens"], 384, 192, "bf16", 2)
            self.assertAlmostEqual(r["bus_bytes"], expected, places=6)

    def test_prepared_series_and_floors(self):
        data = self.plot.prepare(self.doc)
        self.assertEqual(data["comm"], "threads")
        self.assertEqual(set(data["tiers"]), {"fused", "overlap", "column", "token"})
        self.assertEqual(data["tiers"]["token"]["tokens"], [8, 64])  # declined at T=1 < tp
        self.assertEqual(data["tiers"]["fused"]["tokens"], [1, 8, 64])
        chosen = {(r["tokens"], r["tier"]) for r in self.doc["records"] if r["chosen"]}
        self.assertEqual(set(zip(data["chosen"]["tokens"], data["chosen"]["tier"])), chosen)
        floors = data["floors"]
        self.assertEqual(floors["link_source"], "best busbw in this sweep")
        self.assertGreater(floors["link_gbps"], 0)
        # No measured median lies below either floor, and the best run touches each floor's rate.
        for tier, series in data["tiers"].items():
            for t, median in zip(series["tokens"], series["median_us"]):
                i = floors["tokens"].index(t)
                self.assertGreaterEqual(median * (1 + 1e-9), floors["comm_us"][i], (tier, t))
                self.assertGreaterEqual(median * (1 + 1e-9), floors["gemm_us"][i], (tier, t))
        given = self.plot.prepare(self.doc, link_gbps=100.0, gemm_tflops=1.0)
        self.assertEqual((given["floors"]["link_gbps"], given["floors"]["link_source"]), (100.0, "given"))
        t = given["floors"]["tokens"][-1]
        fewest_bytes = t * 2 * (0.5 * 192 + 2 * 0.5 * 384)  # token: RS(l) + RS(d) + AG(d) at tp 2
        self.assertAlmostEqual(given["floors"]["comm_us"][-1], fewest_bytes / 100e9 * 1e6, places=9)
        self.assertAlmostEqual(given["floors"]["gemm_us"][-1], 2 * t * 384 * 192 / 2 / 1e12 * 1e6, places=9)

    def test_the_floors_lmoe_bench_recorded_are_drawn(self):
        # Ranks sharing the CPU get no floors; one rank with --rates does, and the plot takes the
        # lowest tier's at each T.
        self.assertIsNone(self.plot.prepare(self.doc)["floors"]["gpu_us"])
        bench = os.path.join(self.dir.name, "rates.json")
        lmoe("bench", "--backend", "cpu", "--preset", "small", "-n", "1", "-t", "1,8", "--iters", "1",
             "--rates", "100,200,1", "--json", bench)
        with open(bench) as f:
            doc = json.load(f)
        floors = self.plot.prepare(doc)["floors"]
        self.assertEqual(floors["gpu_rates"]["memory_gbps"], 200.0)
        for t, value in zip(floors["tokens"], floors["gpu_us"]):
            self.assertEqual(value, min(r["floor"]["floor_us"] for r in doc["records"]
                                        if r["tokens"] == t and r["floor"]))

    def test_a_tier_table_plots_too_and_bad_input_is_refused(self):
        table = os.path.join(self.dir.name, "t.json")
        lmoe("tune", "--backend", "cpu", "--preset", "small", "-n", "2", "-t", "1,8", "--iters", "2", "--output", table)
        result = subprocess.run([sys.executable, self.path, table, "--print"], capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        data = json.loads(result.stdout)
        self.assertEqual(data["tiers"]["fused"]["tokens"], [1, 8])
        self.assertIn("tp 2, comm threads", data["title"])
        result = subprocess.run([sys.executable, self.path, self.bench, "--comm", "nccl", "--print"],
                                capture_output=True, text=True, timeout=60)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("comm 'nccl' is not in this file", result.stderr)


class TailTimelineScript(unittest.TestCase):
    """scripts/tail_timeline.py on recorded traces (tests/data/fused_trace_k3_t2_layers8.log: K3 tp 1,
    T = 2, 8 tails in one graph, LMOE_FUSED_TRACE=1, an H200, 2026-12-01; and a decode kernel's,
    --kernel decode) and on crafted ones."""

    @classmethod
    def setUpClass(cls):
        import importlib.util
        cls.path = os.path.join(ROOT, "scripts", "tail_timeline.py")
        spec = importlib.util.spec_from_file_location("tail_timeline", cls.path)
        cls.script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cls.script)
        cls.recorded = os.path.join(DATA_DIR, "fused_trace_k3_t2_layers8.log")

    def test_recorded_trace(self):
        with open(self.recorded) as f:
            rows = self.script.timeline(self.script.parse(f.read().splitlines()))
        self.assertEqual([r["tail"] for r in rows], list(range(1, 9)))
        # Tail 2 printed its points after a first entry 1152 ns after tail 1's: entry median 14.34,
        # N ready 20.22, end max 31.78 µs after its own first entry; tail 1's last block ended at
        # 16.06 and its median end at 14.98.
        self.assertAlmostEqual(rows[1]["entry_median"], 1.152 + 14.34, places=2)
        self.assertAlmostEqual(rows[1]["n_ready_median"], 1.152 + 20.22, places=2)
        self.assertAlmostEqual(rows[1]["n_ready_after_previous_end"], 1.152 + 20.22 - 16.06, places=2)
        self.assertAlmostEqual(rows[1]["period"], 1.152 + 30.98 - 14.98, places=2)
        self.assertNotIn("period", rows[0])
        for r in rows:  # on one axis, in order
            self.assertLess(r["entry_median"], r["n_ready_median"])
            self.assertLess(r["n_ready_median"], r["multiplied_median"])
            self.assertLessEqual(r["end_median"], r["end_max"])

    def test_recorded_decode_trace(self):
        # tests/data/fused_trace_decode_stripe_t1_layers8.log: the decode kernel's pair instance, the
        # 896-row stripe at T = 1, 8 tails in one graph, an H200, 2026-12-04 (docs/fused-sessions.md, session
        # 25). Tail 2 printed its points after a first entry 3296 ns after tail 1's: inputs landed
        # 3.84, normed 4.67, end median 6.40 µs after its own first entry; tail 1's last block ended
        # at 5.47 and its median end at 5.28.
        path = os.path.join(os.path.dirname(self.recorded), "fused_trace_decode_stripe_t1_layers8.log")
        with open(path) as f:
            lines = f.read().splitlines()
        rows = self.script.timeline(self.script.parse(lines, "decode"), "decode")
        self.assertEqual([r["tail"] for r in rows], list(range(1, 9)))
        self.assertAlmostEqual(rows[1]["inputs_median"], 3.296 + 3.84, places=2)
        self.assertAlmostEqual(rows[1]["inputs_after_previous_end"], 3.296 + 3.84 - 5.47, places=2)
        self.assertAlmostEqual(rows[1]["norm"], 4.67 - 3.84, places=2)
        self.assertAlmostEqual(rows[1]["period"], 3.296 + 6.40 - 5.28, places=2)
        self.assertNotIn("inputs_after_previous_end", rows[0])
        for r in rows:  # on one axis, in order, the phases adding up
            self.assertLess(r["entry_median"], r["inputs_median"])
            self.assertLess(r["inputs_median"], r["normed_median"])
            self.assertLess(r["normed_median"], r["streamed_median"])
            self.assertAlmostEqual(r["norm"] + r["product"] + r["finish"],
                                   r["end_median"] - r["inputs_median"], places=1)
        # The chained reading of the same file finds nothing; the command line says so.
        self.assertEqual(self.script.parse(lines), [])
        result = subprocess.run([sys.executable, self.path, path], capture_output=True, text=True,
                                timeout=60)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("no chained up-projection trace", result.stderr)
        result = subprocess.run([sys.executable, self.path, path, "--kernel", "decode"],
                                capture_output=True, text=True, timeout=60)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("inputs after prev. last end", result.stdout)

    def test_decode_trace_with_every_point_splits_the_product_and_the_finish(self):
        # Two tails whose traces have every point of the decode kernel since session 26; medians
        # (the middle column) give the phases, the second tail 10 µs after the first on one axis.
        def tail(first_entry_ns, shift):
            points = [("entry", 0.0), ("released", 1.5), ("inputs landed", 2.0), ("normed", 3.0),
                      ("items landed", 3.25), ("warp 0 multiplied", 3.5), ("streamed", 4.0),
                      ("partials stored", 4.25), ("end", 5.0)]
            return ["[ fused trace ] rank 0, decode kernel, grid 2, last call (us after the first entry)"] + \
                [f"[ fused trace ] {name:<20} {v - 0.1 + shift:.2f} {v + shift:.2f} {v + 0.5 + shift:.2f}"
                 for name, v in points] + \
                [f"[ fused trace ] global timer: first entry {first_entry_ns} ns, last stamp {first_entry_ns + 9000} ns"]
        lines = tail(1000, 0.0) + tail(11000, 0.0)
        rows = self.script.timeline(self.script.parse(lines, "decode"), "decode")
        self.assertEqual(len(rows), 2)
        expected = {"read": 0.5, "norm": 1.0, "product": 1.0, "wait": 0.25, "mma": 0.25, "barrier": 0.5,
                    "finish": 1.0, "stores": 0.25, "sums": 0.75}
        for row in rows:
            for phase, value in expected.items():
                self.assertAlmostEqual(row[phase], value, places=2, msg=phase)
            self.assertAlmostEqual(row["wait"] + row["mma"] + row["barrier"], row["product"], places=2)
            self.assertAlmostEqual(row["stores"] + row["sums"], row["finish"], places=2)
        self.assertAlmostEqual(rows[1]["period"], 10.0, places=2)
        self.assertAlmostEqual(rows[1]["inputs_after_previous_end"], 10.0 + 2.0 - 5.5, places=2)
        self.assertAlmostEqual(rows[1]["released_after_previous_end"], 10.0 + 1.5 - 5.5, places=2)
        self.assertNotIn("released_after_previous_end", rows[0])
        # A trace without the points of session 26 (the recorded one) has no such phases.
        path = os.path.join(os.path.dirname(self.recorded), "fused_trace_decode_stripe_t1_layers8.log")
        with open(path) as f:
            recorded = self.script.timeline(self.script.parse(f.read().splitlines(), "decode"), "decode")
        for phase in ("read", "wait", "stores", "released_after_previous_end"):
            self.assertNotIn(phase, recorded[1])

    def test_only_rank_0_and_the_chained_kernel_are_read_and_bad_input_is_refused(self):
        crafted = "\n".join([
            "[ fused trace ] rank 1, chained up-projection, grid 2 (tiles of 64 rows, splits 1), last call",
            "[ fused trace ] entry                0.00     5.00     9.00",
            "[ fused trace ] global timer: first entry 1000 ns, last stamp 9000 ns",
            "[ fused trace ] rank 0, grid 4, general kernel",
            "[ fused trace ] entry                0.00     7.00     7.00",
            "[ fused trace ] global timer: first entry 500 ns, last stamp 9000 ns",
            "[ fused trace ] rank 0, chained up-projection, grid 2 (tiles of 64 rows, splits 1), last call",
            "[ fused trace ] entry                0.00     1.00     2.00",
            "[ fused trace ] N ready              3.00     3.00     3.00",
            "[ fused trace ] end                  8.00     9.00    10.00",
            "[ fused trace ] global timer: first entry 2000 ns, last stamp 12000 ns",
            "[ fused trace ] rank 0, chained up-projection, grid 2 (tiles of 64 rows, splits 1), last call",
            "[ fused trace ] entry                0.00     1.00     2.00",
            "[ fused trace ] N ready              4.00     4.00     4.00",
            "[ fused trace ] end                  8.00     9.00    10.00",
            "[ fused trace ] global timer: first entry 11000 ns, last stamp 21000 ns",
        ])
        rows = self.script.timeline(self.script.parse(crafted.splitlines()))
        self.assertEqual(len(rows), 2)
        self.assertEqual(rows[0]["entry_median"], 1.0)
        self.assertEqual(rows[1]["n_ready_median"], 9.0 + 4.0)
        self.assertEqual(rows[1]["n_ready_after_previous_end"], 13.0 - 10.0)
        self.assertEqual(rows[1]["period"], 18.0 - 9.0)
        with tempfile.TemporaryDirectory() as d:
            empty = os.path.join(d, "empty.log")
            with open(empty, "w") as f:
                f.write("lmoe bench: nothing traced\n")
            result = subprocess.run([sys.executable, self.path, empty], capture_output=True, text=True, timeout=60)
            self.assertNotEqual(result.returncode, 0)
            self.assertIn("no chained up-projection trace", result.stderr)
            out = os.path.join(d, "rows.json")
            result = subprocess.run([sys.executable, self.path, self.recorded, "--json", out],
                                    capture_output=True, text=True, timeout=60)
            self.assertEqual(result.returncode, 0, result.stderr)
            self.assertIn("N after prev. last end", result.stdout)
            with open(out) as f:
                self.assertEqual(len(json.load(f)), 8)


class GpuCheckScript(unittest.TestCase):
    """scripts/gpu_check.sh's stripe stage on a copy of the scripts with stub lmoe binaries (no GPU
    needed): each per-tail bench runs once, and with LMOE_CHECK_BASE once more with the base tree's
    lmoe right after it, its line marked "base:"."""

    STUB = """#!/usr/bin/env bash
echo "TREE pair=${LMOE_FUSED_DECODE_PAIR:-} $*" >>"$CALLS"
echo "lmoe bench: a stub"
echo "     1      1    fused   x x MEDIAN y ok 0"
"""

    def run_stage(self, root, base):
        scripts = os.path.join(root, "scripts")
        os.makedirs(scripts)
        for name in ("gpu_check.sh", "tail_timeline.py"):
            with open(os.path.join(ROOT, "scripts", name)) as src, \
                    open(os.path.join(scripts, name), "w") as dst:
                dst.write(src.read())
        for tree, median in (("main", "5.30"), ("base", "5.50")):
            folder = os.path.join(root, *(["base"] if tree == "base" else []), "build", "cuda")
            os.makedirs(folder)
            stub = os.path.join(folder, "lmoe")
            with open(stub, "w") as f:
                f.write(self.STUB.replace("MEDIAN", median).replace("TREE", tree))
            os.chmod(stub, 0o755)
        open(os.path.join(root, "base", "CMakeLists.txt"), "w").close()
        env = dict(os.environ, LMOE_CHECK_STAGES="stripe", OUT=os.path.join(root, "out"),
                   CALLS=os.path.join(root, "calls.txt"))
        env.pop("LMOE_CHECK_BASE", None)
        if base:
            env["LMOE_CHECK_BASE"] = "base"
        result = subprocess.run(["bash", os.path.join(scripts, "gpu_check.sh")], cwd=root, env=env,
                                capture_output=True, text=True, timeout=120)
        with open(env["CALLS"]) as f:
            calls = f.read().splitlines()
        return result, calls

    def test_the_base_tree_runs_every_per_tail_bench_again(self):
        with tempfile.TemporaryDirectory() as d:
            result, calls = self.run_stage(d, base=True)
            self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
            main_lines = [l for l in result.stdout.splitlines() if l == "1 5.30 0;"]
            base_lines = [l for l in result.stdout.splitlines() if l == "base: 1 5.50 0;"]
            # Per tail routed and with the pair off, 8 layers twice and 1 layer once each: 6 benches.
            self.assertEqual(len(main_lines), 6, result.stdout)
            self.assertEqual(len(base_lines), 6, result.stdout)
            benches = [c for c in calls if "--cold-l2" in c]
            self.assertEqual(len(benches), 12)
            # Each base bench right after its own, with the same arguments and settings.
            for mine, theirs in zip(benches[0::2], benches[1::2]):
                self.assertTrue(mine.startswith("main ") and theirs.startswith("base "), (mine, theirs))
                self.assertEqual(mine.split(" ", 1)[1], theirs.split(" ", 1)[1].replace("_base.json", ".json"))
            self.assertEqual(sum("pair=0" in c for c in benches), 6)
            # The traced timelines (pair and single, T = 1 and 4), each with the base lmoe too.
            traced = [c for c in calls if "--no-check" in c]
            self.assertEqual([c.split(" ", 1)[0] for c in traced], ["main", "base"] * 4)
            self.assertIn("stripe timeline: pair, T=1, 8 layers, traced (base)", result.stdout)
            self.assertTrue(all("--d-model 896" in c for c in benches))
            out = os.listdir(os.path.join(d, "out"))
            self.assertIn("stripe_routed_L8_r1_base.log", out)
            self.assertIn("gpu_check: stripe_nopair_L1_r1_base exit code 0", result.stdout)

    def test_the_scaling_stage_sets_lmoe_beside_the_baseline(self):
        # Two fake GPUs; lmoe's sweep and the baseline's are recordings (tests/data, and medians set
        # here) written where the stage asks; torch "present" for the stage's check only.
        with tempfile.TemporaryDirectory() as d:
            tools = os.path.join(d, "tools")
            os.makedirs(tools)
            os.makedirs(os.path.join(d, "scripts"))
            for name in ("gpu_check.sh", "baseline_table.py"):
                with open(os.path.join(ROOT, "scripts", name)) as src, \
                        open(os.path.join(d, "scripts", name), "w") as dst:
                    dst.write(src.read())
            baseline = {"tool": "torch_baseline", "torch": "stub", "tp": 2, "d_model": 7168, "d_latent": 3584,
                        "dtype": "bf16", "cold_l2": True,
                        "records": [{"tokens": 1, "tier": "column", "mode": "graph", "median_us": 48.9,
                                     "p10_us": 48.0, "p90_us": 49.0}]}
            with open(os.path.join(d, "baseline.json"), "w") as f:
                json.dump(baseline, f)
            json_arg = 'for ((i = 1; i < $#; i++)); do [ "${!i}" = --json ] && j=$((i + 1)) && out="${!j}"; done'
            stubs = {
                "nvidia-smi": 'if [ "$1" = -L ]; then echo "GPU 0: stub"; echo "GPU 1: stub"; else echo 0; fi',
                "torchrun": f'echo "torchrun $*" >>"$CALLS"; {json_arg}; cp "{d}/baseline.json" "$out"',
                "python3": f'if [ "$1" = -c ]; then exit 0; fi; exec {sys.executable} "$@"',
            }
            for name, body in stubs.items():
                with open(os.path.join(tools, name), "w") as f:
                    f.write("#!/usr/bin/env bash\n" + body + "\n")
                os.chmod(os.path.join(tools, name), 0o755)
            os.makedirs(os.path.join(d, "build", "cuda"))
            with open(os.path.join(d, "build", "cuda", "lmoe"), "w") as f:
                f.write(f'#!/usr/bin/env bash\necho "lmoe $*" >>"$CALLS"\n{json_arg}\n'
                        f'[ -n "$out" ] && cp "{os.path.join(DATA_DIR, "bench_k3_tp2.json")}" "$out"\nexit 0\n')
            os.chmod(os.path.join(d, "build", "cuda", "lmoe"), 0o755)
            env = dict(os.environ, LMOE_CHECK_STAGES="scaling", LMOE_SCALING_TPS="2", OUT=os.path.join(d, "out"),
                       CALLS=os.path.join(d, "calls.txt"), PATH=tools + os.pathsep + os.environ["PATH"])
            env.pop("LMOE_CHECK_BASE", None)
            result = subprocess.run(["bash", os.path.join(d, "scripts", "gpu_check.sh")], cwd=d, env=env,
                                    capture_output=True, text=True, timeout=120)
            self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
            with open(env["CALLS"]) as f:
                calls = f.read().splitlines()
            torch_calls = [c for c in calls if c.startswith("torchrun")]
            self.assertEqual(len(torch_calls), 1, calls)
            self.assertIn("--cold-l2", torch_calls[0])
            self.assertIn("== scaling: lmoe against the PyTorch baseline, tp 2", result.stdout)
            self.assertIn("| 1 | – | 48.9 | 33.8 | 30.4 | 28.2 (column, p2p) | 1.73× | – |", result.stdout)
            self.assertIn("only the baseline evicted L2", result.stdout)  # the recorded sweep predates it
            self.assertIn("gpu_check: scaling_vs_torch_tp2 exit code 0", result.stdout)
            with open(os.path.join(d, "out", "scaling_vs_torch_tp2.json")) as f:
                self.assertEqual([r["tokens"] for r in json.load(f)["rows"]], [1])
            self.assertTrue(os.path.exists(os.path.join(d, "out", "scaling_vs_torch_tp2.md")))

    def test_a_base_that_is_not_a_built_source_tree_is_refused_before_anything_runs(self):
        with tempfile.TemporaryDirectory() as d:
            for base, error in (("nowhere", "is not a source tree"),
                                ("empty", "has no build/cuda/lmoe and the build stage is not asked for")):
                os.makedirs(os.path.join(d, "empty"), exist_ok=True)
                open(os.path.join(d, "empty", "CMakeLists.txt"), "w").close()
                script = os.path.join(ROOT, "scripts", "gpu_check.sh")
                env = dict(os.environ, LMOE_CHECK_STAGES="stripe", OUT=os.path.join(d, "out"),
                           LMOE_CHECK_BASE=os.path.join(d, base))
                result = subprocess.run(["bash", script], env=env, capture_output=True, text=True,
                                        timeout=60)
                self.assertEqual(result.returncode, 2, result.stdout + result.stderr)
                self.assertIn("LMOE_CHECK_BASE=" + os.path.join(d, base), result.stderr)
                self.assertIn(error, result.stderr)
                self.assertNotIn("== stripe", result.stdout)

    def test_without_a_base_tree_each_bench_runs_once(self):
        with tempfile.TemporaryDirectory() as d:
            result, calls = self.run_stage(d, base=False)
            self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
            self.assertNotIn("base:", result.stdout)
            self.assertEqual(len([c for c in calls if "--cold-l2" in c]), 6)
            self.assertEqual(len([c for c in calls if "--no-check" in c]), 4)
            self.assertFalse(any(c.startswith("base ") for c in calls))


class BaselineTableScript(unittest.TestCase):
    """scripts/baseline_table.py: lmoe's recorded H200 sweep (tests/data) against a baseline file
    whose medians are set here, every column computed again from the two files."""

    SCRIPT = os.path.join(ROOT, "scripts", "baseline_table.py")
    BENCH = os.path.join(DATA_DIR, "bench_k3_tp2.json")

    def baseline(self, d, **changes):
        doc = {"tool": "torch_baseline", "torch": "2.15", "tp": 2, "d_model": 7168, "d_latent": 3584, "dtype": "bf16",
               "records": [{"tokens": t, "tier": tier, "mode": "graph", "median_us": us, "p10_us": us, "p90_us": us}
                           for t, tier, us in [(1, "overlap", 55.8), (1, "column", 48.9), (128, "overlap", 82.2),
                                               (128, "column", 99.1), (3, "overlap", 60.0)]]}
        doc.update(changes)
        path = os.path.join(d, "torch.json")
        with open(path, "w") as f:
            json.dump(doc, f)
        return path

    def run_script(self, *args):
        return subprocess.run([sys.executable, self.SCRIPT, *args], capture_output=True, text=True, timeout=60)

    def test_rows_are_the_two_files_side_by_side(self):
        with open(self.BENCH) as f:
            bench = json.load(f)
        # Floors on two records at T = 128 (the recording has none): the lower one is the row's floor.
        for r in bench["records"]:
            if r["tokens"] == 128 and r["status"] == "ran" and r["comm"] == "p2p":
                r["floor"] = {"floor_us": 40.0 if r["tier"] == "column" else 25.0}
        with tempfile.TemporaryDirectory() as d:
            bench_path = os.path.join(d, "bench.json")
            with open(bench_path, "w") as f:
                json.dump(bench, f)
            out = os.path.join(d, "rows.json")
            result = self.run_script(bench_path, self.baseline(d), "--json", out)
            self.assertEqual(result.returncode, 0, result.stderr)
            with open(out) as f:
                rows = json.load(f)["rows"]
        self.assertEqual([r["tokens"] for r in rows], [1, 128])
        for row in rows:
            t = row["tokens"]
            ran = [r for r in bench["records"] if r["tokens"] == t and r["status"] == "ran"]
            best = min(ran, key=lambda r: r["median_us"])
            self.assertEqual((row["lmoe_best_tier"], row["lmoe_best_comm"]), (best["tier"], best["comm"]))
            self.assertEqual(row["lmoe_best_us"], best["median_us"])
            nccl = {r["tier"]: r["median_us"] for r in ran if r["comm"] == "nccl"}
            self.assertEqual(row["lmoe_overlap_nccl_us"], nccl["overlap"])
            self.assertEqual(row["lmoe_column_nccl_us"], nccl["column"])
            torch_best = {1: 48.9, 128: 82.2}[t]
            self.assertAlmostEqual(row["speedup"], torch_best / best["median_us"])
        self.assertIsNone(rows[0]["floor_us"])
        self.assertEqual(rows[1]["floor_us"], 25.0)
        self.assertAlmostEqual(rows[1]["best_over_floor"], rows[1]["lmoe_best_us"] / 25.0)
        self.assertIn("| 1 | 55.8 | 48.9 | 33.8 | 30.4 | 28.2 (column, p2p) | 1.73× | – |", result.stdout)
        self.assertIn("baseline [3]", result.stdout)
        self.assertNotIn("evicted L2", result.stdout)  # neither run did

    def test_runs_that_treated_l2_differently_are_flagged(self):
        with tempfile.TemporaryDirectory() as d:
            result = self.run_script(self.BENCH, self.baseline(d, cold_l2=True))
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("# note: only the baseline evicted L2 before each timed iteration", result.stdout)

    def test_files_of_another_tail_or_kind_are_refused(self):
        with tempfile.TemporaryDirectory() as d:
            for changes, args, message in [
                ({"tp": 4}, None, "tp differs: lmoe bench 2, baseline 4"),
                ({"dtype": "f16"}, None, "dtype differs"),
                ({"tool": "other"}, None, "not the JSON of scripts/torch_baseline.py"),
                ({"records": []}, None, "no T in common"),
                ({}, "swapped", "not the JSON of `lmoe bench --json`"),
            ]:
                with self.subTest(message=message):
                    base = self.baseline(d, **changes)
                    result = self.run_script(*((base, self.BENCH) if args else (self.BENCH, base)))
                    self.assertNotEqual(result.returncode, 0)
                    self.assertIn(message, result.stderr)
                    self.assertNotIn("| T |", result.stdout)

if __name__ == "__main__":
    LMOE = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
