#!/usr/bin/env python3
"""The timeline of consecutive chained up-projections from an LMOE_FUSED_TRACE run.

    LMOE_FUSED_TRACE=1 build/cuda/lmoe bench --backend cuda -n 1 --comm p2p --tiers fused -t 2 \
        --layers 8 --warmup 5 --iters 20 --no-check 2>&1 | python3 scripts/tail_timeline.py

Each traced kernel prints its points (µs after its first block's entry: min / median / max over
blocks) and the global timer (ns) at that first entry. With `--layers N` the tails of one graph each
print theirs, so their points land on one time axis: this prints, per tail, the median entry, when N
was ready, the last wgmma and the end (median and last block), all in µs after the first tail's
first entry, and the two figures that say what passes between tails — from the previous tail's last
block to this one's N ready, and the period (median end to median end). --json FILE writes the same
rows. Only the chained up-projection's traces are read (one rank: rank 0's).
"""
import argparse
import json
import re
import sys

HEADER = re.compile(r"\[ fused trace \] rank (\d+), chained up-projection")
POINT = re.compile(r"\[ fused trace \] (\S.*?)\s+(-?[\d.]+)\s+(-?[\d.]+)\s+(-?[\d.]+)\s*$")
TIMER = re.compile(r"\[ fused trace \] global timer: first entry (\d+) ns, last stamp (\d+) ns")


def parse(lines):
    """The chained up-projection traces of rank 0, in the order printed."""
    traces, current = [], None
    for line in lines:
        header = HEADER.search(line)
        if header:
            current = {"rank": int(header.group(1)), "points": {}} if header.group(1) == "0" else None
            continue
        if current is None:
            continue
        timer = TIMER.search(line)
        if timer:
            current["first_entry_ns"] = int(timer.group(1))
            traces.append(current)
            current = None
            continue
        point = POINT.search(line)
        if point and point.group(1) != "global timer:":
            current["points"][point.group(1)] = tuple(float(point.group(i)) for i in (2, 3, 4))
    return traces


def timeline(traces):
    """Rows per tail, by first entry, times in µs after the first tail's first entry."""
    traces = sorted(traces, key=lambda t: t["first_entry_ns"])
    if not traces:
        return []
    origin = traces[0]["first_entry_ns"]
    rows = []
    for i, trace in enumerate(traces):
        shift = (trace["first_entry_ns"] - origin) / 1e3  # integers: ns exceed a double's exact range
        at = {name: tuple(v + shift for v in values) for name, values in trace["points"].items()}
        row = {"tail": i + 1}
        for key, name in (("entry", "entry"), ("n_ready", "N ready"), ("multiplied", "multiplied"),
                          ("end", "end")):
            if name in at:
                row[key + "_median"] = round(at[name][1], 2)
                row[key + "_max"] = round(at[name][2], 2)
        if rows and "n_ready_median" in row and "end_max" in rows[-1]:
            row["n_ready_after_previous_end"] = round(row["n_ready_median"] - rows[-1]["end_max"], 2)
        if rows and "end_median" in row and "end_median" in rows[-1]:
            row["period"] = round(row["end_median"] - rows[-1]["end_median"], 2)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", nargs="?", help="the run's output (standard input if omitted)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    text = open(args.log).read() if args.log else sys.stdin.read()
    rows = timeline(parse(text.splitlines()))
    if not rows:
        sys.exit("tail_timeline: no chained up-projection trace with a global timer line found")
    columns = [("tail", "tail"), ("entry_median", "entry"), ("n_ready_median", "N ready"),
               ("multiplied_median", "multiplied"), ("multiplied_max", "(last)"),
               ("end_median", "end"), ("end_max", "(last)"),
               ("n_ready_after_previous_end", "N after prev. last end"), ("period", "period")]
    print("  ".join(f"{title:>10}" for _, title in columns) + "   (µs)")
    for row in rows:
        print("  ".join(f"{row[key]:>10}" if key in row else f"{'–':>10}" for key, _ in columns))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
