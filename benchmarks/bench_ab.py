#!/usr/bin/env python3
"""Two builds of lmoe side by side: per (comm, tier, T), this tree's median against a base tree's
from the JSON of `lmoe bench --json` run with each (benchmarks/fused_timeline.sh with LMOE_CHECK_BASE
writes $OUT/TAG.json and $OUT/TAG_base.json for every per-tail bench).

    python3 benchmarks/bench_ab.py --dir OUT          # every TAG.json that has a TAG_base.json
    python3 benchmarks/bench_ab.py THIS.json BASE.json [THIS2.json BASE2.json ...] [--json ROWS.json]

A row: the two medians (µs), this − base and its share of base, and `~` where the two runs' p10–p90
ranges overlap (a difference inside the iterations' own spread). The last line counts the rows where
this tree is faster and gives the median difference over all rows. Prints a Markdown table.
"""
import argparse
import json
import os
import statistics
import sys


def read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench_ab: {path}: {e}")


def is_bench(doc):
    return isinstance(doc, dict) and doc.get("command") == "bench"


def load(path):
    doc = read(path)
    if not is_bench(doc):
        raise SystemExit(f"bench_ab: {path} is not the JSON of `lmoe bench --json`")
    return doc


def timings(doc):
    """{(comm, tier, T): record} of the runs that ran."""
    return {(r["comm"], r["tier"], r["tokens"]): r for r in doc["records"]
            if r["status"] == "ran" and r.get("median_us") is not None}


def pairs_in(folder):
    """(tag, this, base) for every TAG.json of `lmoe bench` beside a TAG_base.json, by tag (other
    JSON there, such as tail_timeline.py's, is passed over)."""
    found = []
    for name in sorted(os.listdir(folder)):
        if name.endswith("_base.json"):
            tag = name[: -len("_base.json")]
            mine, base = os.path.join(folder, tag + ".json"), os.path.join(folder, name)
            if os.path.exists(mine) and is_bench(read(mine)) and is_bench(read(base)):
                found.append((tag, mine, base))
    return found


def rows(tag, this_doc, base_doc):
    mine, base = timings(this_doc), timings(base_doc)
    out = []
    for key in sorted(set(mine) & set(base), key=lambda k: (k[0], k[1], k[2])):
        a, b = mine[key], base[key]
        overlap = a["p10_us"] <= b["p90_us"] and b["p10_us"] <= a["p90_us"]
        out.append({"tag": tag, "comm": key[0], "tier": key[1], "tokens": key[2], "this_us": a["median_us"],
                    "base_us": b["median_us"], "delta_us": a["median_us"] - b["median_us"],
                    "delta_share": a["median_us"] / b["median_us"] - 1, "spreads_overlap": overlap})
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="pairs: THIS.json BASE.json ...")
    parser.add_argument("--dir", help="a folder of TAG.json and TAG_base.json files (fused_timeline.sh's $OUT)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if bool(args.dir) == bool(args.files):
        parser.error("give either --dir or pairs of files")
    if args.files and len(args.files) % 2:
        parser.error("files come in pairs: THIS.json BASE.json")
    if args.dir:
        pairs = pairs_in(args.dir)
        if not pairs:
            raise SystemExit(f"bench_ab: no TAG.json beside a TAG_base.json in {args.dir}")
    else:
        pairs = [(os.path.basename(a)[: -len(".json")] if a.endswith(".json") else a, a, b)
                 for a, b in zip(args.files[0::2], args.files[1::2])]
    table = []
    for tag, mine, base in pairs:
        found = rows(tag, load(mine), load(base))
        if not found:
            print(f"# {tag}: no (comm, tier, T) that both runs measured", file=sys.stderr)
        table += found
    if not table:
        raise SystemExit("bench_ab: nothing to compare")
    print("| bench | comm | tier | T | this µs | base µs | this − base | |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['tag']} | {r['comm']} | {r['tier']} | {r['tokens']} | {r['this_us']:.2f} | {r['base_us']:.2f} "
              f"| {r['delta_us']:+.2f} ({r['delta_share']:+.1%}) | {'~' if r['spreads_overlap'] else ''} |")
    faster = sum(r["delta_us"] < 0 for r in table)
    print(f"# this tree faster in {faster} of {len(table)} rows; median difference "
          f"{statistics.median(r['delta_us'] for r in table):+.2f} µs; ~: the p10–p90 ranges overlap")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "bench_ab", "pairs": [list(p) for p in pairs], "rows": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
