"""End-to-end tests of `lmoe tail` on safetensors files (checked against an independent numpy
implementation of the tail), malformed files, `explain`, `run --json`, bad environment variables and
`lmoe layer`. Usage: test_tail_command.py PATH_TO_LMOE"""

import json
import os
import struct
import tempfile
import unittest

import numpy as np

import cli_support
from cli_support import to_bf16_bits, from_bf16_bits, write_safetensors, read_output, make_case, expected_tail, lmoe


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
        self.assertEqual((doc["mode"], doc["cold_l2"], doc["repeats"]), ("eager", False, 2))
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

    def test_layer_graph_and_cold_l2_are_refused_on_the_cpu(self):
        graph = lmoe("layer", "--preset", "small", "-n", "1", "-t", "1", "--graph", check=False)
        self.assertNotEqual(graph.returncode, 0)
        self.assertIn("--graph: CUDA graphs need --backend cuda; the cpu backend runs eagerly only", graph.stderr)
        # Also with --cold-l2, which --graph allows: the backend is what is wrong.
        both = lmoe("layer", "--preset", "small", "-n", "1", "-t", "1", "--graph", "--cold-l2", check=False)
        self.assertNotEqual(both.returncode, 0)
        self.assertIn("--graph: CUDA graphs need --backend cuda", both.stderr)
        cold = lmoe("layer", "--preset", "small", "-n", "1", "-t", "1", "--cold-l2", check=False)
        self.assertNotEqual(cold.returncode, 0)
        self.assertIn("--cold-l2: needs --graph", cold.stderr)

    def test_layer_help_describes_graph_cold_l2_and_dump_dir(self):
        text = " ".join(lmoe("layer", "--help").stdout.split())
        self.assertIn("--graph cuda: capture each T's forward into a CUDA graph and time its replays", text)
        self.assertIn("eager forwards are the default", text)
        self.assertIn("--cold-l2 with --graph: evict the GPU's L2 before each replay", text)
        self.assertIn("--dump-dir", text)
        self.assertIn("with --graph 50 timed replays", text)

    def test_layer_dump_dir_writes_x_y_and_the_routing_per_t(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "dump")
            lmoe("layer", "--preset", "small", "--scale", "1", "-n", "2", "-t", "0,3", "--repeats", "1",
                 "--dump-dir", out)
            self.assertEqual(sorted(os.listdir(out)), ["t3.safetensors"])  # T = 0 has nothing to write
            with open(os.path.join(out, "t3.safetensors"), "rb") as f:
                data = f.read()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        self.assertEqual(header["__metadata__"]["mode"], "eager")
        self.assertEqual(header["__metadata__"]["tp"], "2")
        shapes = {name: (entry["dtype"], entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
        self.assertEqual(shapes, {"x": ("BF16", [3, 384]), "y": ("BF16", [3, 384]),
                                  "expert_ids": ("F32", [3, 4]), "expert_weights": ("F32", [3, 4])})
        begin, end = header["expert_ids"]["data_offsets"]
        ids = np.frombuffer(data[8 + n + begin : 8 + n + end], dtype=np.float32)
        self.assertTrue(np.all((ids >= 0) & (ids < 16) & (ids == np.round(ids))), ids)
        begin, end = header["y"]["data_offsets"]
        y = from_bf16_bits(np.frombuffer(data[8 + n + begin : 8 + n + end], dtype=np.uint16))
        self.assertTrue(np.all(np.isfinite(y)))  # written, not the poison

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
    def write_small_checkpoint(path, layer, skip=(), mxfp4=False):
        """The small preset's layer (d 384, l 192, 16 experts, I 64, shared 2 x 48) by its tensor names;
        with mxfp4 the routed experts as the small-mxfp4 preset names them: "<name>_packed" (U8, two
        e2m1 values a byte) and "<name>_scale" (U8 E8M0, one per 32 values), scales near 2^-4."""
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
        def mxfp4_blocks(name, rows, cols):
            tensors[name + "_packed"] = ("U8", (rows, cols // 2),
                                         rng.integers(0, 256, rows * cols // 2, dtype=np.uint8).tobytes())
            tensors[name + "_scale"] = ("U8", (rows, cols // 32),
                                        rng.integers(120, 124, rows * cols // 32, dtype=np.uint8).tobytes())

        for e in range(experts):
            for kind, shape, fan_in in (("gate", (inter, l), l), ("up", (inter, l), l), ("down", (l, inter), inter)):
                name = moe + f"experts.{e}.{kind}.weight"
                if mxfp4:
                    mxfp4_blocks(name, *shape)
                else:
                    tensors[name] = bf16(shape, fan_in)
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

    def test_keeps_mxfp4_experts_packed_and_prints_their_bytes(self):
        # Per rank of 2: gate and up [16, 32, 192], down [16, 192, 32]; MXFP4 holds half a byte a
        # value and a scale byte per 32 values, bf16 two bytes a value.
        values = 3 * 16 * 32 * 192
        packed, dequantized = values // 2 + values // 32, values * 2
        other = 16 * 384 * 4 + 16 * 4 + (192 * 384 + 192 + 384 * 192) * 2 + 3 * (96 // 2) * 384 * 2
        with tempfile.TemporaryDirectory() as tmp:
            self.write_small_checkpoint(os.path.join(tmp, "model.safetensors"), layer=0, mxfp4=True)
            path = os.path.join(tmp, "layer.json")
            common = ("layer", "--preset", "small-mxfp4", "--weights", tmp, "--layer", "0", "-n", "2", "-t", "1,9",
                      "--repeats", "1")
            result = lmoe(*common, "--keep-packed", "--json", path)
            self.assertIn("all rows ok", result.stdout)
            self.assertIn("(experts kept packed)", result.stdout)
            self.assertIn(f"# weights of rank 0: {packed + other} B (", result.stdout)
            self.assertIn(f"; routed experts {packed} B (", result.stdout)
            self.assertRegex(result.stdout, rf"packed as MXFP4, {dequantized} B \([0-9.]+ MiB\) dequantized to bf16")
            with open(path) as f:
                doc = json.load(f)
            self.assertEqual(doc["weight_bytes"], {
                "total": packed + other, "routed_experts": packed, "routed_experts_dequantized": dequantized,
                "routed_experts_mxfp4": packed, "other": other, "experts_packed": True})
            # What building the layers took on rank 0's GPU: null and not printed on the cpu backend;
            # on cuda at least rank 0's weights as held, printed as written.
            device_bytes = doc["layer_device_bytes"]
            if device_bytes is None:
                self.assertNotIn("device memory in use", result.stdout)
            else:
                self.assertGreaterEqual(device_bytes, packed + other)
                self.assertIn(f"GPU grew by {device_bytes} B (", result.stdout)
            packed_rows = [(row["tokens"], row["ok"]) for row in doc["rows"]]

            # Dequantized at load (the default): the same layer, and the bytes before packing.
            result = lmoe(*common, "--json", path)
            self.assertIn("all rows ok", result.stdout)
            self.assertIn(f"; routed experts {dequantized} B (", result.stdout)
            self.assertRegex(result.stdout, rf"dense, {packed} B \([0-9.]+ MiB\) as MXFP4 blocks and scales")
            with open(path) as f:
                doc = json.load(f)
            self.assertEqual(doc["weight_bytes"]["total"], dequantized + other)
            self.assertFalse(doc["weight_bytes"]["experts_packed"])
            self.assertEqual([(row["tokens"], row["ok"]) for row in doc["rows"]], packed_rows)

            # tp 4 would split down's 32-column blocks; the bf16 checkpoint has nothing to keep packed.
            result = lmoe(*common[:7], "-n", "4", "-t", "1", "--keep-packed", check=False)
            self.assertEqual(result.returncode, 2, result.stderr)
            self.assertIn("I/tp = 64/4 = 16 is not a multiple of 32", result.stderr)
            for args, needle in (
                    (("--preset", "small", "--weights", tmp, "--layer", "0"), "--preset small are not MXFP4"),
                    (("--preset", "small-mxfp4",), "--keep-packed: give --weights and --layer")):
                result = lmoe("layer", *args, "--keep-packed", "-t", "1", check=False)
                self.assertEqual(result.returncode, 2, result.stderr)
                self.assertIn(needle, result.stderr)

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


if __name__ == "__main__":
    cli_support.main()
