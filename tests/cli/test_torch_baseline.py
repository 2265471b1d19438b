"""scripts/torch_baseline.py, the PyTorch baseline (the reference system's `overlap` and `column`
tails in plain torch.distributed + torch.mm), against lmoe on the CPU: the baseline runs as gloo
ranks, dumps its input and each tier's output as safetensors, `lmoe tail --backend cpu` runs the
same tier on that input, and scripts/compare_safetensors.py compares the two outputs. This is the
chain scripts/gpu_check.sh runs on every GPU of a machine (its `baseline` stage), checked here
without a GPU, in f32: the torch Debian ships (1.13, CPU only) has no bf16 all-reduce in gloo and
no f16 matmul on the CPU.

Needs a python3 with torch (gloo) and safetensors: LMOE_TORCH_PYTHON, else python3 or
/usr/bin/python3 (scripts/install-deps.sh --tests installs Debian's torch); without one every test
is skipped and the file exits 77. Usage: test_torch_baseline.py PATH_TO_LMOE"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import unittest

from cli_support import ROOT

LMOE = None
BASELINE = os.path.join(ROOT, "scripts", "torch_baseline.py")
COMPARE = os.path.join(ROOT, "scripts", "compare_safetensors.py")
PROBE = "import torch, torch.distributed as d, safetensors.torch; assert d.is_available() and d.is_gloo_available()"


def torch_python():
    """The first interpreter that can run the baseline on the CPU, or None."""
    candidates = [os.environ.get("LMOE_TORCH_PYTHON"), sys.executable, shutil.which("python3"), "/usr/bin/python3"]
    for python in candidates:
        if python and os.path.exists(python):
            probe = subprocess.run([python, "-c", PROBE], capture_output=True, timeout=120)
            if probe.returncode == 0:
                return python
    return None


PYTHON = None


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_baseline(tp, tokens, out_dir, *extra):
    """torch_baseline.py as `tp` gloo ranks (the env:// rendezvous torchrun would set up); returns
    each rank's (returncode, output)."""
    port = free_port()
    ranks = []
    for rank in range(tp):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(tp), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        args = [PYTHON, BASELINE, "--device", "cpu", "--preset", "small", "--dtype", "f32", "-t",
                ",".join(map(str, tokens)), "--iters", "1", "--warmup", "0", "--dump-dir", out_dir,
                "--json", os.path.join(out_dir, "baseline.json"), *extra]
        ranks.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for process in ranks:
        output, _ = process.communicate(timeout=300)
        results.append((process.returncode, output))
    return results


def compare(expected, actual):
    """compare_safetensors.py's exit code and its report line's relative difference."""
    result = subprocess.run([sys.executable, COMPARE, expected, actual, "--max-rel", "1e-5"],
                            capture_output=True, text=True, timeout=120)
    match = re.search(r"max \|a-b\| / max \|a\| ([0-9.e+-]+)", result.stdout)
    return result.returncode, float(match.group(1)) if match else None, result.stdout + result.stderr


class BaselineAgainstLmoe(unittest.TestCase):
    """tp 2 and 3 ranks (d = 384, l = 192: stripes of 192 and 128 columns), T = 1 (below tp) and 5."""

    TOKENS = (1, 5)

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.TemporaryDirectory()
        cls.runs = {}
        for tp in (2, 3):
            out = os.path.join(cls.dir.name, f"tp{tp}")
            cls.runs[tp] = (out, run_baseline(tp, cls.TOKENS, out))

    @classmethod
    def tearDownClass(cls):
        cls.dir.cleanup()

    def lmoe_tail(self, tier, source, output, *extra):
        return subprocess.run([LMOE, "tail", "--backend", "cpu", "--tier", tier, "--check", "--input", source,
                               "--output", output, *extra], capture_output=True, text=True, timeout=300)

    def test_every_rank_finishes_and_reports_each_tier(self):
        for tp, (out, ranks) in self.runs.items():
            with self.subTest(tp=tp):
                for code, output in ranks:
                    self.assertEqual(code, 0, output)
                with open(os.path.join(out, "baseline.json")) as f:
                    doc = json.load(f)
                self.assertEqual(doc["tp"], tp)
                self.assertEqual((doc["d_model"], doc["d_latent"], doc["dtype"]), (384, 192, "f32"))
                seen = sorted((r["tokens"], r["tier"]) for r in doc["records"])
                self.assertEqual(seen, sorted((t, tier) for t in self.TOKENS for tier in ("overlap", "column")))
                for r in doc["records"]:
                    self.assertGreater(r["median_us"], 0)
                    self.assertLessEqual(r["p10_us"], r["p90_us"])

    def test_lmoe_computes_what_the_baseline_computes(self):
        for tp, (out, _) in self.runs.items():
            for tokens in self.TOKENS:
                for tier in ("overlap", "column"):
                    with self.subTest(tp=tp, tokens=tokens, tier=tier):
                        mine = os.path.join(out, f"t{tokens}_lmoe_{tier}.safetensors")
                        result = self.lmoe_tail(tier, os.path.join(out, f"t{tokens}_input.safetensors"), mine)
                        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
                        self.assertIn(f"tier: {tier}", result.stdout)
                        self.assertIn("0 beyond the bound", result.stdout)
                        code, relative, report = compare(os.path.join(out, f"t{tokens}_{tier}.safetensors"), mine)
                        self.assertEqual(code, 0, report)
                        self.assertIn(f"output [{tokens}, 384]", report)
                        # The orders of the norm's and the GEMM's sums differ; f32 keeps them within ~1e-6.
                        self.assertIsNotNone(relative, report)
                        self.assertLess(relative, 1e-5, report)

    def test_the_side_by_side_table_reads_both_runs(self):
        # scripts/baseline_table.py on a CPU sweep of lmoe and this baseline run (the same tail: tp 2,
        # d 384, l 192, f32): a row per T, lmoe's fastest and the speed-up taken from the two files.
        out = self.runs[2][0]
        bench = os.path.join(out, "lmoe_bench.json")
        result = subprocess.run([LMOE, "bench", "--backend", "cpu", "--preset", "small", "--dtype", "f32", "-n", "2",
                                 "-t", "1,5", "--iters", "2", "--json", bench], capture_output=True, text=True,
                                timeout=300)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        rows_path = os.path.join(out, "rows.json")
        table = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "baseline_table.py"), bench,
                                os.path.join(out, "baseline.json"), "--json", rows_path],
                               capture_output=True, text=True, timeout=120)
        self.assertEqual(table.returncode, 0, table.stdout + table.stderr)
        with open(rows_path) as f:
            rows = json.load(f)["rows"]
        with open(os.path.join(out, "baseline.json")) as f:
            torch_runs = json.load(f)["records"]
        self.assertEqual([r["tokens"] for r in rows], list(self.TOKENS))
        for row in rows:
            torch_best = min(r["median_us"] for r in torch_runs if r["tokens"] == row["tokens"])
            self.assertAlmostEqual(row["speedup"], torch_best / row["lmoe_best_us"])
            self.assertIn(f"| {row['tokens']} | ", table.stdout)

    def test_a_different_eps_is_caught(self):
        # The comparison must see a real difference in the math: lmoe with eps 0.1 (the baseline's 1e-5)
        # moves the norm by ~2 % at these inputs' mean square (~2).
        out = self.runs[2][0]
        mine = os.path.join(out, "t5_lmoe_overlap_eps.safetensors")
        result = self.lmoe_tail("overlap", os.path.join(out, "t5_input.safetensors"), mine, "--eps", "0.1")
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        code, relative, report = compare(os.path.join(out, "t5_overlap.safetensors"), mine)
        self.assertEqual(code, 1, report)
        self.assertGreater(relative, 1e-3, report)

    def test_cold_l2_is_refused_on_the_cpu(self):
        result = subprocess.run([PYTHON, BASELINE, "--device", "cpu", "--cold-l2"], capture_output=True, text=True,
                                timeout=120)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertIn("--cold-l2 needs --device cuda", result.stderr)

    def test_a_dtype_gloo_cannot_take_is_refused_on_every_rank(self):
        # Only where this torch cannot (Debian's 1.13): bf16 is refused before any work, on every rank.
        with tempfile.TemporaryDirectory() as out:
            ranks = run_baseline(2, (1,), out, "--dtype", "bf16")
        if all(code == 0 for code, _ in ranks):
            self.skipTest("this torch runs bf16 with gloo on the CPU")
        for code, output in ranks:
            self.assertNotEqual(code, 0, output)
            self.assertIn("--device cpu: torch", output)
            self.assertIn("use --dtype f32", output)


if __name__ == "__main__":
    LMOE = os.path.abspath(sys.argv.pop(1))
    PYTHON = torch_python()
    if PYTHON is None:
        print("skipped: no python3 with torch (gloo) and safetensors; scripts/install-deps.sh --tests installs them")
        sys.exit(77)
    print(f"torch baseline run with {PYTHON}")
    unittest.main(verbosity=2)
