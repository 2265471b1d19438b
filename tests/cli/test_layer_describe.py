"""End-to-end tests of `lmoe layer --describe`: every preset's layer as one JSON object (what
benchmarks/torch_moe.py reads instead of its own copy), the same layer that a run reports in its
--json, --scale and --experts applied, and the run options refused. Usage: test_layer_describe.py
PATH_TO_LMOE"""

import json
import os
import re
import tempfile
import unittest

import numpy as np

import cli_support
from cli_support import lmoe

ROUTER_FIELDS = {"num_experts": int, "top_k": int, "n_group": int, "topk_group": int, "score": str,
                 "correction_bias": bool, "renormalize": bool, "routed_scaling_factor": float}
LAYER_FIELDS = {"preset": str, "lmoe_version": str, "scale": int, "d_model": int, "d_latent": int, "router": dict,
                "expert_intermediate": int, "num_shared_experts": int, "shared_intermediate": int,
                "activation": str, "activation_beta": float, "activation_linear_beta": float, "latent_norm": bool,
                "dtype": str, "eps": float, "experts_mxfp4": bool, "tensor_names": dict}
TENSOR_NAMES = ["router_weight", "router_bias", "latent_down", "latent_norm", "latent_up", "expert_gate",
                "expert_up", "expert_down", "shared_gate", "shared_up", "shared_down"]


def describe(*args):
    result = lmoe("layer", "--describe", *args)
    return json.loads(result.stdout), result


def all_presets():
    """Every preset lmoe knows, from the message that refuses an unknown one."""
    refused = lmoe("layer", "--preset", "no-such-model", "--describe", check=False)
    match = re.search(r"unknown preset 'no-such-model': expected one of (.*)", refused.stderr)
    assert match, refused.stderr
    return match.group(1).strip().split(", ")


class LayerDescribe(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # Every preset: described, or refused for want of a layer description. A preset added to
        # src/models/ is tested without this file changing; the ones known today must be among them.
        cls.with_layer = []
        for preset in all_presets():
            result = lmoe("layer", "--describe", "--preset", preset, check=False)
            if result.returncode == 0:
                cls.with_layer.append(preset)
            else:
                assert f"--preset {preset}: no layer description" in result.stderr, result.stderr
        assert {"kimi-k3", "nemotron-3-super", "small", "small-mxfp4"} <= set(cls.with_layer), cls.with_layer

    def test_every_preset_prints_one_json_object_with_every_field(self):
        for preset in self.with_layer:
            with self.subTest(preset=preset):
                doc, result = describe("--preset", preset)
                self.assertEqual(result.stderr, "")
                self.assertEqual(set(doc), set(LAYER_FIELDS))
                for key, kind in LAYER_FIELDS.items():
                    self.assertIsInstance(doc[key], kind, key)
                self.assertEqual(set(doc["router"]), set(ROUTER_FIELDS))
                for key, kind in ROUTER_FIELDS.items():
                    self.assertIsInstance(doc["router"][key], kind, key)
                self.assertEqual(set(doc["tensor_names"]), set(TENSOR_NAMES))
                for role in TENSOR_NAMES:
                    self.assertIsInstance(doc["tensor_names"][role], str, role)
                self.assertEqual((doc["preset"], doc["scale"], doc["dtype"]), (preset, 8, "bf16"))
                self.assertIn(doc["router"]["score"], ["sigmoid", "softmax"])
                self.assertIn(doc["activation"], ["silu_glu", "situ_glu", "relu2"])
                self.assertEqual(doc["eps"], 1e-05)  # the float's shortest decimal, not its double expansion
                # Every layer has a router and both latent projections; a gate exactly where gated.
                names = doc["tensor_names"]
                for role in ["router_weight", "latent_down", "latent_up", "expert_up", "expert_down"]:
                    self.assertNotEqual(names[role], "", role)
                self.assertIn("{expert}", names["expert_up"])
                self.assertEqual(names["expert_gate"] != "", doc["activation"] != "relu2")
                self.assertEqual(names["latent_norm"] != "", doc["latent_norm"])
                self.assertEqual(names["router_bias"] != "", doc["router"]["correction_bias"])

    def test_the_layer_is_the_one_a_run_reports(self):
        # The run's --json at the same --scale names the same dims, router and experts.
        for preset in self.with_layer:
            for scale in ["8", "32"]:
                with self.subTest(preset=preset, scale=scale), tempfile.TemporaryDirectory() as tmp:
                    doc, _ = describe("--preset", preset, "--scale", scale)
                    path = os.path.join(tmp, "layer.json")
                    lmoe("layer", "--preset", preset, "--scale", scale, "-n", "1", "-t", "1", "--repeats", "1",
                         "--no-check", "--json", path)
                    with open(path) as f:
                        run = json.load(f)
                    router = doc["router"]
                    self.assertEqual((doc["d_model"], doc["d_latent"], router["num_experts"], router["top_k"]),
                                     (run["d_model"], run["d_latent"], run["num_experts"], run["top_k"]))
                    self.assertEqual((router["n_group"], router["topk_group"]), (run["n_group"], run["topk_group"]))
                    for key in ["scale", "expert_intermediate", "num_shared_experts", "shared_intermediate",
                                "activation", "dtype"]:
                        self.assertEqual(doc[key], run[key], key)
                    # The run writes these floats as doubles: equal once rounded to float.
                    self.assertEqual(np.float32(router["routed_scaling_factor"]),
                                     np.float32(run["routed_scaling_factor"]))
                    self.assertEqual(np.float32(doc["eps"]), np.float32(run["eps"]))

    def test_the_models_own_layers(self):
        kimi, _ = describe("--preset", "kimi-k3", "--scale", "1")
        self.assertEqual((kimi["d_model"], kimi["d_latent"], kimi["router"]["num_experts"], kimi["router"]["top_k"]),
                         (7168, 3584, 896, 16))
        self.assertEqual((kimi["activation"], kimi["activation_beta"], kimi["activation_linear_beta"]),
                         ("situ_glu", 4.0, 25.0))
        self.assertTrue(kimi["experts_mxfp4"])
        self.assertEqual(kimi["tensor_names"]["expert_gate"],
                         "language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight")
        nemotron, _ = describe("--preset", "nemotron-3-super", "--scale", "1")
        self.assertEqual((nemotron["router"]["routed_scaling_factor"], nemotron["activation"],
                          nemotron["latent_norm"], nemotron["experts_mxfp4"]), (5.0, "relu2", False, False))
        self.assertEqual((nemotron["num_shared_experts"], nemotron["shared_intermediate"]), (1, 5376))
        for role in ["latent_norm", "expert_gate", "shared_gate"]:
            self.assertEqual(nemotron["tensor_names"][role], "", role)
        small, _ = describe("--preset", "small", "--scale", "1")
        small_mxfp4, _ = describe("--preset", "small-mxfp4", "--scale", "1")
        self.assertEqual((small["router"]["n_group"], small["router"]["topk_group"],
                          small["router"]["routed_scaling_factor"]), (4, 2, 2.5))
        self.assertEqual((small["experts_mxfp4"], small_mxfp4["experts_mxfp4"]), (False, True))
        del small["preset"], small["experts_mxfp4"], small_mxfp4["preset"], small_mxfp4["experts_mxfp4"]
        self.assertEqual(small, small_mxfp4)

    def test_scale_experts_dims_and_eps_apply(self):
        doc, _ = describe("--preset", "small", "--scale", "2", "--experts", "32", "--eps", "1e-6")
        self.assertEqual((doc["scale"], doc["d_model"], doc["d_latent"], doc["expert_intermediate"]), (2, 192, 96, 32))
        self.assertEqual((doc["router"]["num_experts"], doc["eps"]), (32, 1e-06))
        doc, _ = describe("--preset", "small", "--scale", "1", "--d-model", "768")
        self.assertEqual((doc["d_model"], doc["d_latent"]), (768, 192))
        bad = lmoe("layer", "--describe", "--preset", "small", "--experts", "2", check=False)
        self.assertEqual(bad.returncode, 2)
        self.assertIn("layer config: top_k", bad.stderr)
        self.assertEqual(bad.stdout, "")

    def test_run_options_are_refused(self):
        for option in [["-t", "1"], ["-n", "1"], ["--backend", "cpu"], ["--graph"], ["--no-check"],
                       ["--json", "x.json"], ["--weights", "w", "--layer", "0"], ["--seed", "3"]]:
            with self.subTest(option=option):
                result = lmoe("layer", "--describe", "--preset", "small", *option, check=False)
                self.assertEqual(result.returncode, 2)
                name = "--" + {"-t": "tokens", "-n": "ranks"}.get(option[0], option[0][2:])
                self.assertRegex(result.stderr, rf"--describe: prints the layer without running it; drop "
                                                rf"{name} \(an option of a run\)")
                self.assertEqual(result.stdout, "")

    def test_a_preset_without_a_layer_is_refused(self):
        result = lmoe("layer", "--describe", "--preset", "nemotron-3-ultra", check=False)
        self.assertEqual(result.returncode, 2)
        self.assertIn("--preset nemotron-3-ultra: no layer description", result.stderr)
        self.assertEqual(result.stdout, "")

    def test_help_says_what_describe_takes(self):
        text = " ".join(lmoe("layer", "--help").stdout.split())
        self.assertIn("--describe", text)
        self.assertIn("refuses the run options", text)


if __name__ == "__main__":
    cli_support.main()
