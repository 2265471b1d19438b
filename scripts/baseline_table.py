#!/usr/bin/env python3
"""lmoe against the PyTorch baseline, side by side: one row per T that both runs measured, from the
JSON of `lmoe bench --json` and of scripts/torch_baseline.py --json on the same GPUs (the stage
`scaling` of scripts/gpu_check.sh writes both at each tp).

    python3 scripts/baseline_table.py LMOE_BENCH.json TORCH_BASELINE.json [--json OUT.json]

Columns, median µs: the baseline's `overlap` and `column`; lmoe's `overlap` and `column` over NCCL
(the baseline's transport); lmoe's fastest run at T over every tier and comm; how many times faster
lmoe's fastest is than the baseline's fastest; and lmoe's fastest against the floor `lmoe bench`
recorded at T (the lowest of its tiers' floors: bytes over the links, bytes through memory, FLOPs
over the GEMM rate; docs/bench.md), where the file has floors. Both files must describe the same
tail (tp, d_model, d_latent, dtype); a mismatch is an error. Prints a Markdown table.
"""
import argparse
import json
import sys


def load(path, what):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"baseline_table: {what} {path}: {e}")


def check_same_tail(bench, base):
    """Both files describe one tail, or an error that names what differs."""
    if bench.get("command") != "bench":
        raise SystemExit("baseline_table: the first file is not the JSON of `lmoe bench --json`")
    if base.get("tool") != "torch_baseline":
        raise SystemExit("baseline_table: the second file is not the JSON of scripts/torch_baseline.py --json")
    for key in ("tp", "d_model", "d_latent", "dtype"):
        if bench.get(key) != base.get(key):
            raise SystemExit(f"baseline_table: {key} differs: lmoe bench {bench.get(key)!r}, baseline {base.get(key)!r}")


def fmt(value, digits=1):
    return "–" if value is None else f"{value:.{digits}f}"


def rows(bench, base):
    """One dict per T both files measured, ascending."""
    ran = [r for r in bench["records"] if r["status"] == "ran" and r.get("median_us") is not None]
    torch = {(r["tokens"], r["tier"]): r["median_us"] for r in base["records"]}
    table = []
    for t in sorted({r["tokens"] for r in ran} & {t for t, _ in torch}):
        at = [r for r in ran if r["tokens"] == t]
        nccl = {r["tier"]: r["median_us"] for r in at if r["comm"] == "nccl"}
        best = min(at, key=lambda r: r["median_us"])
        floors = [r["floor"]["floor_us"] for r in at if r.get("floor")]
        torch_best = min(v for (tt, _), v in torch.items() if tt == t)
        table.append({
            "tokens": t,
            "torch_overlap_us": torch.get((t, "overlap")),
            "torch_column_us": torch.get((t, "column")),
            "lmoe_overlap_nccl_us": nccl.get("overlap"),
            "lmoe_column_nccl_us": nccl.get("column"),
            "lmoe_best_us": best["median_us"],
            "lmoe_best_tier": best["tier"],
            "lmoe_best_comm": best["comm"],
            "lmoe_best_mode": best.get("mode"),
            "speedup": torch_best / best["median_us"],
            "floor_us": min(floors) if floors else None,
            "best_over_floor": best["median_us"] / min(floors) if floors else None,
        })
    return table


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bench", help="lmoe bench --json output")
    parser.add_argument("baseline", help="scripts/torch_baseline.py --json output")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    bench, base = load(args.bench, "lmoe bench JSON"), load(args.baseline, "baseline JSON")
    check_same_tail(bench, base)
    table = rows(bench, base)
    if not table:
        raise SystemExit("baseline_table: the two files have no T in common")
    modes = sorted({r["mode"] for r in bench["records"] if r["status"] == "ran" and r.get("mode")})
    base_modes = sorted({r["mode"] for r in base["records"]})
    gpu = (bench.get("gpu") or {}).get("name", bench.get("backend", ""))
    print(f"# lmoe against the PyTorch baseline: d {bench['d_model']}, l {bench['d_latent']}, {bench['dtype']}, "
          f"tp {bench['tp']}, {gpu}{', L2 evicted before each' if bench.get('cold_l2') and base.get('cold_l2') else ''}; "
          f"lmoe {'/'.join(modes)} ({bench.get('date', '')[:10]}), "
          f"baseline {'/'.join(base_modes)} (torch {base.get('torch', '?')}); median µs")
    if modes != base_modes:
        print(f"# note: the runs were timed differently (lmoe {'/'.join(modes)}, baseline {'/'.join(base_modes)})")
    cold = {"lmoe": bool(bench.get("cold_l2")), "baseline": bool(base.get("cold_l2"))}
    if cold["lmoe"] != cold["baseline"]:
        print("# note: only " + ("lmoe" if cold["lmoe"] else "the baseline") + " evicted L2 before each timed "
              "iteration (--cold-l2): the other read weights that may have stayed in L2")
    print("| T | torch overlap | torch column | lmoe overlap nccl | lmoe column nccl | lmoe best (tier, comm) "
          "| best vs best | lmoe best / floor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['tokens']} | {fmt(r['torch_overlap_us'])} | {fmt(r['torch_column_us'])} "
              f"| {fmt(r['lmoe_overlap_nccl_us'])} | {fmt(r['lmoe_column_nccl_us'])} "
              f"| {fmt(r['lmoe_best_us'])} ({r['lmoe_best_tier']}, {r['lmoe_best_comm']}) "
              f"| {r['speedup']:.2f}× | {fmt(r['best_over_floor'], 2) + '×' if r['best_over_floor'] else '–'} |")
    only_bench = sorted({r["tokens"] for r in bench["records"]} - {r["tokens"] for r in table})
    only_base = sorted({r["tokens"] for r in base["records"]} - {r["tokens"] for r in table})
    if only_bench or only_base:
        print(f"# T measured by one run only: lmoe {only_bench or '–'}, baseline {only_base or '–'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "baseline_table", "bench": args.bench, "baseline": args.baseline,
                       "cold_l2": cold,
                       "tp": bench["tp"], "d_model": bench["d_model"], "d_latent": bench["d_latent"],
                       "dtype": bench["dtype"], "rows": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
