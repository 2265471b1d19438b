"""The scripts around lmoe, run on lmoe's own output or on stubs (no GPU): plot_bench.py's data
preparation, benchmarks/tail_timeline.py, the GPU scripts' usage comments, gpu_check.sh's scaling
stage, benchmarks/fused_timeline.sh's stripe stage and its A/B of two builds, benchmarks/probes.sh,
baseline_table.py, benchmarks/bench_ab.py, fuzz.sh's argument checks.
Usage: test_scripts.py PATH_TO_LMOE"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

import cli_support
from cli_support import ROOT, DATA_DIR, lmoe


def load_plot_script():
    import importlib.util
    path = os.path.join(ROOT, "scripts", "plot_bench.py")
    spec = importlib.util.spec_from_file_location("plot_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module



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
    """benchmarks/tail_timeline.py on recorded traces (tests/data/fused_trace_k3_t2_layers8.log: K3 tp 1,
    T = 2, 8 tails in one graph, LMOE_FUSED_TRACE=1, an H200, 2026-12-01; and a decode kernel's,
    --kernel decode) and on crafted ones."""

    @classmethod
    def setUpClass(cls):
        import importlib.util
        cls.path = os.path.join(ROOT, "benchmarks", "tail_timeline.py")
        spec = importlib.util.spec_from_file_location("tail_timeline", cls.path)
        cls.script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cls.script)
        cls.recorded = os.path.join(DATA_DIR, "fused_trace_k3_t2_layers8.log")

    def test_recorded_chained_trace_puts_every_tail_on_one_axis(self):
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

    def test_recorded_decode_trace_gives_the_phases_and_only_the_decode_reading_takes_it(self):
        # tests/data/fused_trace_decode_stripe_t1_layers8.log: the decode kernel's pair instance, the
        # 896-row stripe at T = 1, 8 tails in one graph, an H200, 2026-12-04. Tail 2 printed its
        # points after a first entry 3296 ns after tail 1's: inputs landed 3.84, normed 4.67, end
        # median 6.40 µs after its own first entry; tail 1's last block ended at 5.47 and its median
        # end at 5.28.
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
        # Two tails whose traces have every point the decode kernel can print; medians
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
        # A trace without the release, items and partials points (the recorded one) has no such phases.
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


def copy_tree_files(root, *paths):
    """Copies the source tree's files at paths (relative to it) to the same paths under root."""
    for path in paths:
        os.makedirs(os.path.join(root, os.path.dirname(path)), exist_ok=True)
        with open(os.path.join(ROOT, path)) as src, open(os.path.join(root, path), "w") as dst:
            dst.write(src.read())


class GpuScriptUsage(unittest.TestCase):
    """The usage comment of each GPU script (scripts/gpu_check.sh and those of benchmarks/ on its
    frame) names exactly the stages the script runs, and its default runs only stages it has."""

    SCRIPTS = ("scripts/gpu_check.sh", "benchmarks/probes.sh", "benchmarks/profile.sh",
               "benchmarks/fused_timeline.sh")

    def test_the_usage_lists_every_stage_and_no_other(self):
        import re
        for path in self.SCRIPTS:
            with self.subTest(script=path):
                with open(os.path.join(ROOT, path)) as f:
                    text = f.read()
                listed = re.search(r"^#.*a subset of: (.*)$", text, re.M)
                self.assertIsNotNone(listed, "no 'a subset of:' line in the usage comment")
                listed = listed.group(1).split()
                self.assertEqual(len(listed), len(set(listed)))
                self.assertEqual(set(listed), set(re.findall(r"\bwants (\w+)", text)))
                defaults = set()
                for value in (re.findall(r'default_stages="([^"]*)"', text)
                              + re.findall(r"\$\{LMOE_CHECK_STAGES:-([^}]*)\}", text)):
                    defaults.update(word for word in value.split() if not word.startswith("$"))
                self.assertTrue(defaults, "no default stages found")
                self.assertLessEqual(defaults, set(listed))

    def test_nvlink_multicast_stays_off_in_every_gpu_script(self):
        with open(os.path.join(ROOT, "scripts", "gpu_check_lib.sh")) as f:
            frame = f.read()
        self.assertIn("export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1", frame)
        for path in self.SCRIPTS:
            with self.subTest(script=path), open(os.path.join(ROOT, path)) as f:
                text = f.read()
                # The frame is sourced before any stage runs.
                self.assertIn("\nsource scripts/gpu_check_lib.sh\n", text)
                self.assertLess(text.index("source scripts/gpu_check_lib.sh"), text.index("\nif wants "))


class GpuCheckScript(unittest.TestCase):
    """scripts/gpu_check.sh's scaling stage on a copy of the scripts with stub binaries and two fake
    GPUs (no GPU needed)."""

    def test_the_scaling_stage_sets_lmoe_beside_the_baseline(self):
        # Two fake GPUs; lmoe's sweep and the baseline's are recordings (tests/data, and medians set
        # here) written where the stage asks; torch "present" for the stage's check only.
        with tempfile.TemporaryDirectory() as d:
            tools = os.path.join(d, "tools")
            os.makedirs(tools)
            copy_tree_files(d, "scripts/gpu_check.sh", "scripts/gpu_check_lib.sh", "scripts/baseline_table.py")
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


class FusedTimelineScript(unittest.TestCase):
    """benchmarks/fused_timeline.sh's stripe stage on a copy of the scripts with stub lmoe binaries (no
    GPU needed): each per-tail bench runs once, and with LMOE_CHECK_BASE once more with the base
    tree's lmoe right after it, its line marked "base:"."""

    STUB = """#!/usr/bin/env bash
echo "TREE pair=${LMOE_FUSED_DECODE_PAIR:-} $*" >>"$CALLS"
echo "lmoe bench: a stub"
echo "     1      1    fused   x x MEDIAN y ok 0"
for ((i = 1; i < $#; i++)); do [ "${!i}" = --json ] && j=$((i + 1)) && out="${!j}"; done
[ -n "${out:-}" ] && echo '{"command": "bench", "records": [{"comm": "p2p", "tier": "fused", "tokens": 1,
  "status": "ran", "median_us": MEDIAN, "p10_us": MEDIAN, "p90_us": MEDIAN}]}' >"$out"
exit 0
"""

    def run_stage(self, root, base):
        copy_tree_files(root, "scripts/gpu_check_lib.sh", "benchmarks/fused_timeline.sh",
                        "benchmarks/tail_timeline.py", "benchmarks/bench_ab.py")
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
        result = subprocess.run(["bash", os.path.join(root, "benchmarks", "fused_timeline.sh")], cwd=root, env=env,
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
            self.assertIn("fused_timeline: stripe_nopair_L1_r1_base exit code 0", result.stdout)
            # Then every bench of both trees side by side (benchmarks/bench_ab.py).
            self.assertIn("== A/B: this tree against base", result.stdout)
            self.assertIn("| stripe_routed_L8_r1 | p2p | fused | 1 | 5.30 | 5.50 | -0.20 (-3.6%) |  |", result.stdout)
            self.assertIn("# this tree faster in 6 of 6 rows; median difference -0.20 µs", result.stdout)
            self.assertIn("fused_timeline: ab exit code 0", result.stdout)
            self.assertIn("ab.md", out)

    def test_a_base_that_is_not_a_built_source_tree_is_refused_before_anything_runs(self):
        with tempfile.TemporaryDirectory() as d:
            for base, error in (("nowhere", "is not a source tree"),
                                ("empty", "has no build/cuda/lmoe and the build stage is not asked for")):
                os.makedirs(os.path.join(d, "empty"), exist_ok=True)
                open(os.path.join(d, "empty", "CMakeLists.txt"), "w").close()
                script = os.path.join(ROOT, "benchmarks", "fused_timeline.sh")
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
            self.assertNotIn("A/B", result.stdout)
            self.assertEqual(len([c for c in calls if "--cold-l2" in c]), 6)
            self.assertEqual(len([c for c in calls if "--no-check" in c]), 4)
            self.assertFalse(any(c.startswith("base ") for c in calls))


class ProbesScript(unittest.TestCase):
    """benchmarks/probes.sh with stub probe binaries (no GPU needed): each probe runs with its JSON in
    $OUT, the spin probe once per setting, and a stage not asked for runs nothing."""

    def run_probes(self, root, stages):
        copy_tree_files(root, "scripts/gpu_check_lib.sh", "benchmarks/probes.sh")
        folder = os.path.join(root, "build", "cuda", "benchmarks")
        os.makedirs(folder, exist_ok=True)
        for name in ("lmoe_spin_probe", "lmoe_launch_floor", "lmoe_stream_probe", "lmoe_tma_stream_probe"):
            with open(os.path.join(folder, name), "w") as f:
                f.write(f'#!/usr/bin/env bash\necho "{name} ${{CUDA_DEVICE_MAX_CONNECTIONS:-}} $*" >>"$CALLS"\n')
            os.chmod(os.path.join(folder, name), 0o755)
        env = dict(os.environ, LMOE_CHECK_STAGES=stages, OUT=os.path.join(root, "out"),
                   CALLS=os.path.join(root, "calls.txt"))
        open(env["CALLS"], "w").close()
        result = subprocess.run(["bash", os.path.join(root, "benchmarks", "probes.sh")], cwd=root, env=env,
                                capture_output=True, text=True, timeout=120)
        with open(env["CALLS"]) as f:
            return result, f.read().splitlines()

    def test_each_probe_runs_with_its_json_in_out(self):
        with tempfile.TemporaryDirectory() as d:
            result, calls = self.run_probes(d, "probe stream")
            self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
            out = os.path.join(d, "out")
            self.assertEqual([c.split(" --json")[0] for c in calls], [
                "lmoe_spin_probe 8", "lmoe_spin_probe 32", "lmoe_spin_probe 32", "lmoe_launch_floor ",
                "lmoe_stream_probe ", "lmoe_stream_probe  --rows 896",
                "lmoe_tma_stream_probe ", "lmoe_tma_stream_probe  --rows 896"])
            self.assertIn(f"--json {out}/probe_CUDA_DEVICE_MAX_CONNECTIONS_32_CUDA_MODULE_LOADING_LAZY.json", calls[2])
            self.assertIn(f"--json {out}/tma_stream_probe_896.json", calls[-1])
            self.assertIn("probes: logs in " + out, result.stdout)

    def test_a_stage_not_asked_for_runs_nothing(self):
        with tempfile.TemporaryDirectory() as d:
            result, calls = self.run_probes(d, "stream")
            self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
            self.assertEqual([c.split()[0] for c in calls], ["lmoe_stream_probe"] * 2 + ["lmoe_tma_stream_probe"] * 2)
            self.assertNotIn("spin probe", result.stdout)


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


class BenchAbScript(unittest.TestCase):
    """benchmarks/bench_ab.py on bench files written here: every row's difference, the spread marker,
    pairing by folder (other JSON passed over), and what it refuses."""

    SCRIPT = os.path.join(ROOT, "benchmarks", "bench_ab.py")

    @staticmethod
    def bench(path, runs):
        """runs: [(tier, T, median, p10, p90)], plus one declined record that must not count."""
        records = [{"comm": "p2p", "tier": tier, "tokens": t, "status": "ran", "median_us": m, "p10_us": lo,
                    "p90_us": hi} for tier, t, m, lo, hi in runs]
        records.append({"comm": "p2p", "tier": "token", "tokens": 1, "status": "declined", "median_us": None})
        with open(path, "w") as f:
            json.dump({"command": "bench", "records": records}, f)

    def run_script(self, *args):
        return subprocess.run([sys.executable, self.SCRIPT, *args], capture_output=True, text=True, timeout=60)

    def test_a_folders_pairs_give_each_rows_difference_and_spread(self):
        with tempfile.TemporaryDirectory() as d:
            self.bench(os.path.join(d, "a.json"), [("fused", 1, 5.0, 4.9, 5.1), ("fused", 4, 6.0, 5.5, 6.5)])
            self.bench(os.path.join(d, "a_base.json"), [("fused", 1, 5.5, 5.4, 5.6), ("fused", 4, 6.2, 6.1, 6.3),
                                                        ("fused", 16, 9.0, 9.0, 9.0)])
            self.bench(os.path.join(d, "lonely_base.json"), [("fused", 1, 1.0, 1.0, 1.0)])
            with open(os.path.join(d, "t_base.json"), "w") as f, open(os.path.join(d, "t.json"), "w") as g:
                json.dump({"tails": []}, f)  # a timeline's JSON: passed over
                json.dump({"tails": []}, g)
            rows_path = os.path.join(d, "rows.json")
            result = self.run_script("--dir", d, "--json", rows_path)
            self.assertEqual(result.returncode, 0, result.stderr)
            with open(rows_path) as f:
                doc = json.load(f)
        self.assertEqual([p[0] for p in doc["pairs"]], ["a"])
        self.assertEqual([(r["tokens"], round(r["delta_us"], 6), r["spreads_overlap"]) for r in doc["rows"]],
                         [(1, -0.5, False), (4, -0.2, True)])
        self.assertIn("| a | p2p | fused | 1 | 5.00 | 5.50 | -0.50 (-9.1%) |  |", result.stdout)
        self.assertIn("| a | p2p | fused | 4 | 6.00 | 6.20 | -0.20 (-3.2%) | ~ |", result.stdout)
        self.assertIn("# this tree faster in 2 of 2 rows; median difference -0.35 µs", result.stdout)

    def test_unpaired_foreign_or_disjoint_files_are_refused_with_the_cause(self):
        with tempfile.TemporaryDirectory() as d:
            mine, other = os.path.join(d, "mine.json"), os.path.join(d, "other.json")
            self.bench(mine, [("fused", 1, 5.0, 5.0, 5.0)])
            self.bench(other, [("overlap", 1, 5.0, 5.0, 5.0)])
            table = os.path.join(d, "table.json")
            with open(table, "w") as f:
                json.dump({"format": "lmoe-tier-table"}, f)
            for args, message in [([], "give either --dir or pairs of files"),
                                  (["--dir", d, mine, mine], "give either --dir or pairs of files"),
                                  ([mine], "files come in pairs"),
                                  ([mine, table], "table.json is not the JSON of `lmoe bench --json`"),
                                  ([mine, os.path.join(d, "missing.json")], "missing.json"),
                                  ([mine, other], "nothing to compare"),
                                  (["--dir", os.path.join(d)], "no TAG.json beside a TAG_base.json")]:
                with self.subTest(message=message):
                    result = self.run_script(*args)
                    self.assertNotEqual(result.returncode, 0)
                    self.assertIn(message, result.stderr)
                    self.assertNotIn("| bench |", result.stdout)


class FuzzScript(unittest.TestCase):
    """scripts/fuzz.sh refuses bad arguments before it installs or builds anything, and names the
    targets tests/CMakeLists.txt lists."""

    def run_script(self, *args):
        return subprocess.run(["bash", os.path.join(ROOT, "scripts", "fuzz.sh"), *args],
                              capture_output=True, text=True, timeout=60)

    def test_bad_arguments_are_refused_naming_what_is_allowed(self):
        with open(os.path.join(ROOT, "tests", "CMakeLists.txt")) as f:
            listed = next(line for line in f if line.startswith("set(LMOE_FUZZ_TARGETS "))
        targets = listed[len("set(LMOE_FUZZ_TARGETS "):].strip().rstrip(")")
        for args, message in [(["0"], "SECONDS must be a whole number > 0, got '0'"),
                              (["ten"], "SECONDS must be a whole number > 0, got 'ten'"),
                              (["5", "tier_table", "nosuch"], f"no target 'nosuch' (targets: {targets})")]:
            with self.subTest(args=args):
                result = self.run_script(*args)
                self.assertEqual(result.returncode, 2, result.stderr)
                self.assertIn(message, result.stderr)
                self.assertNotIn("install-deps", result.stderr)
                self.assertNotIn("fuzz: ", result.stdout)


if __name__ == "__main__":
    cli_support.main()
