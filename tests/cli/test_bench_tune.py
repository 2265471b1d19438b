"""End-to-end tests of `lmoe bench`, `lmoe tune` and its tier tables, and of tables derived from and
checked against recorded sweeps (`--from-sweep`, on a CPU sweep and on the H200 recordings of
tests/data/). Usage: test_bench_tune.py PATH_TO_LMOE"""

import json
import math
import os
import tempfile
import unittest

import cli_support
from cli_support import DATA_DIR, write_safetensors, make_case, lmoe


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
            (["--layers", "0"], "bench: layers: expected 1 to 64 tails a timed iteration, got 0"),
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



def range_boundary(a, b, times_a, times_b, lower, upper):
    """Where a range boundary between grid T a < b goes (docs/tuning.md): where the lower and upper
    tiers' medians cross, interpolated linearly in T, when both ran at both points and each leads at
    its own end; else floor(sqrt(a*b)). times_a, times_b: {tier: median_us} at a and b."""
    if all(tier in times for tier in (lower, upper) for times in (times_a, times_b)):
        lead_lo, lead_hi = times_a[upper] - times_a[lower], times_b[lower] - times_b[upper]
        if lead_lo >= 0 and lead_hi >= 0 and lead_lo + lead_hi > 0:
            return min(max(math.floor(a + (b - a) * lead_lo / (lead_lo + lead_hi)), a), b - 1)
    return math.isqrt(a * b)


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
             f"{self.sweep}: is a recorded sweep of tier times, not a tier table"),
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

    def test_a_table_tuned_from_the_h200_sweep_passes_the_recorded_check_and_the_old_table_fails_it(self):
        bench, check = os.path.join(DATA_DIR, "bench_k3_tp2.json"), os.path.join(DATA_DIR, "check_k3_tp2.json")
        table = self.path("tiers_k3_tp2_v3.json")
        result = lmoe("tune", "--from-sweep", bench, "--comm", "nccl", "-o", table)
        self.assertIn("ranges: column T<=76, overlap T<=648, token above (regret: total 0.0% over 8 T", result.stdout)
        self.assertIn("(NVIDIA H200, cc 9.0), from the sweep recorded in", result.stdout)
        with open(table) as f:
            p = json.load(f)["provenance"]
        self.assertEqual((p["gpu"]["name"], p["nccl_version"], p["tp"], p["comm"], p["iters"]),
                         ("NVIDIA H200", "2.28.3", 2, "nccl", 50))
        # Checked against the second sweep recorded on that machine: every choice is the fastest.
        result = lmoe("bench", "--check-table", table, "--from-sweep", check)
        self.assertIn("policy check ok (7 choice(s) judged)", result.stdout)
        self.assertEqual(result.stdout.count(" fastest\n"), 7)
        # The table `lmoe tune` wrote on that machine (version 2, breakpoints) fails the same check,
        # with the verdicts recorded there.
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

    def test_floors_of_the_h200_sweep_come_from_its_known_rates_for_one_rank_per_gpu(self):
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


if __name__ == "__main__":
    cli_support.main()
