"""benchmarks/torch_moe.py, the latent MoE layer in plain PyTorch, against `lmoe layer --backend cpu`:
the script writes a synthetic checkpoint of the small preset, lmoe loads it (--weights) and dumps x,
y and its routing per T (--dump-dir), and the script runs the same x on the CPU and compares y at
the layer's tolerances (its --device cpu self-test; the GPU run times both, docs/bench.md).

Needs a python3 with torch: LMOE_TORCH_PYTHON, else build/python-venv's, python3 or /usr/bin/python3;
without one every test is skipped and the file exits 77. Usage: test_torch_moe.py PATH_TO_LMOE"""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from cli_support import ROOT

LMOE = None
PYTHON = None
SCRIPT = os.path.join(ROOT, "benchmarks", "torch_moe.py")
PROBE = "import torch, torch.nn.functional as F; assert hasattr(F, 'rms_norm')"


def torch_python():
    """The first interpreter with a torch that has F.rms_norm (2.4 and later), or None."""
    candidates = [os.environ.get("LMOE_TORCH_PYTHON"), os.path.join(ROOT, "build", "python-venv", "bin", "python"),
                  sys.executable, shutil.which("python3"), "/usr/bin/python3"]
    for python in candidates:
        if python and os.path.exists(python):
            if subprocess.run([python, "-c", PROBE], capture_output=True, timeout=120).returncode == 0:
                return python
    return None


def script(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([PYTHON, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=600)


def lmoe_layer(checkpoint, dump, *extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMOE_")}
    result = subprocess.run([LMOE, "layer", "--backend", "cpu", "--preset", "small", "--weights", checkpoint,
                             "--layer", "0", "-n", "2", "-t", "1,5", "--repeats", "1", "--dump-dir", dump, *extra],
                            capture_output=True, text=True, env=env, timeout=600)
    if result.returncode != 0:
        raise AssertionError(f"lmoe layer failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


class TorchMoeAgainstLmoe(unittest.TestCase):
    """The small preset (d 384, l 192, 16 experts top-4 in 4 groups, SiLU-GLU, 2 shared), tp 2, T = 1 and 5."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.checkpoint = os.path.join(cls.tmp.name, "ckpt")
        generated = script("--preset", "small", "--generate", cls.checkpoint, "--seed", "7")
        assert generated.returncode == 0, generated.stdout + generated.stderr
        cls.dump = os.path.join(cls.tmp.name, "dump")
        lmoe_layer(cls.checkpoint, cls.dump)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_the_same_checkpoint_and_inputs_agree_within_the_layers_tolerances(self):
        result = script("--device", "cpu", "--preset", "small", "--weights", self.checkpoint, "--check-lmoe",
                        self.dump)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        for tokens in (1, 5):
            self.assertRegex(result.stdout, rf"check T={tokens}: {tokens}/{tokens} tokens routed alike, normwise "
                                            r"\S+ \(tolerance 0.01\), worst row \S+ \(tolerance 0.06\): ok")

    def test_other_weights_fail_the_check(self):
        # The same layer from another seed: a script that ignored its checkpoint, or compared nothing,
        # would pass here too.
        other = os.path.join(self.tmp.name, "other")
        generated = script("--preset", "small", "--generate", other, "--seed", "8")
        self.assertEqual(generated.returncode, 0, generated.stderr)
        result = script("--device", "cpu", "--preset", "small", "--weights", other, "--check-lmoe", self.dump)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn("FAIL", result.stdout)

    def test_a_checkpoint_of_fewer_experts_is_the_same_layer_to_both(self):
        # --experts 8: the script writes 8 experts (router rows included), lmoe loads 8; a full
        # checkpoint with --experts 8 is refused by the router weight's shape.
        fewer = os.path.join(self.tmp.name, "fewer")
        generated = script("--preset", "small", "--experts", "8", "--generate", fewer, "--seed", "9")
        self.assertEqual(generated.returncode, 0, generated.stdout + generated.stderr)
        dump = os.path.join(self.tmp.name, "fewer_dump")
        lmoe_layer(fewer, dump, "--experts", "8")
        result = script("--device", "cpu", "--preset", "small", "--experts", "8", "--weights", fewer,
                        "--check-lmoe", dump)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("check T=5: ", result.stdout)
        refused = subprocess.run([LMOE, "layer", "--backend", "cpu", "--preset", "small", "--weights",
                                  self.checkpoint, "--layer", "0", "-n", "2", "-t", "1", "--experts", "8"],
                                 capture_output=True, text=True, timeout=600)
        self.assertNotEqual(refused.returncode, 0)
        self.assertIn("[16, 384]", refused.stderr)

    def test_an_empty_dump_folder_is_named(self):
        empty = os.path.join(self.tmp.name, "empty")
        os.makedirs(empty, exist_ok=True)
        result = script("--device", "cpu", "--preset", "small", "--weights", self.checkpoint, "--check-lmoe", empty)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(f"--check-lmoe {empty}: no t*.safetensors files", result.stderr)

    def test_the_layer_comes_from_lmoe(self):
        # No layer of its own: a preset lmoe has no layer for is refused with lmoe's words.
        result = script("--preset", "nemotron-3-ultra", "--generate", os.path.join(self.tmp.name, "ultra"),
                        "--lmoe", LMOE)
        self.assertEqual(result.returncode, 1, result.stdout + result.stderr)
        self.assertIn("--preset nemotron-3-ultra --scale 1 --describe failed (2): lmoe: error: --preset "
                      "nemotron-3-ultra: no layer description", result.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp.name, "ultra")))

    def test_lmoe_timing_needs_a_gpu(self):
        result = script("--device", "cpu", "--preset", "small", "--weights", self.checkpoint, "--lmoe", LMOE)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertIn("--lmoe times lmoe and PyTorch on a GPU: it needs --device cuda", result.stderr)


if __name__ == "__main__":
    LMOE = os.path.abspath(sys.argv.pop(1))
    PYTHON = torch_python()
    if PYTHON is None:
        print("skipped: no python3 with torch 2.4 or later (F.rms_norm); scripts/setup.sh makes build/python-venv")
        sys.exit(77)
    print(f"torch_moe.py run with {PYTHON}")
    unittest.main(verbosity=2)
