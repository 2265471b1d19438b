#!/usr/bin/env python3
"""The timeline of consecutive fused kernels from an LMOE_FUSED_TRACE run.

    LMOE_FUSED_TRACE=1 build/cuda/lmoe bench --backend cuda -n 1 --comm p2p --tiers fused -t 2 \
        --layers 8 --warmup 5 --iters 20 --no-check 2>&1 | python3 benchmarks/tail_timeline.py

Each traced kernel prints its points (µs after its first block's entry: min / median / max over
blocks) and the global timer (ns) at that first entry. With `--layers N` the tails of one graph each
print theirs, so their points land on one time axis: this prints, per tail, the median entry, when N
was ready, the last wgmma and the end (median and last block), all in µs after the first tail's
first entry, and the two figures that say what passes between tails — from the previous tail's last
block to this one's N ready, and the period (median end to median end). --json FILE writes the same
rows. Only the chained up-projection's traces are read (one rank: rank 0's), or with --kernel decode
the decode kernel's: per tail its entry, inputs landed, N (normed), the product's end (streamed) and
the end, the inputs after the previous tail's last block, the phases between them (norm, product,
finish: medians over blocks; where the trace has the points, the release of griddepcontrol.wait
after the previous tail's last block and the read of the inputs after it, the product split into
warp 0's wait, its mma and the barrier, and the finish into the partials' stores and the sums) and
the period.
"""
import argparse
import json
import re
import sys

# Per kernel: the header of its trace, and its points as (row key, printed name).
KERNELS = {
    "chained": ("chained up-projection",
                (("entry", "entry"), ("n_ready", "N ready"), ("multiplied", "multiplied"),
                 ("end", "end"))),
    "decode": ("decode kernel",
               (("entry", "entry"), ("released", "released"), ("inputs", "inputs landed"),
                ("normed", "normed"),
                ("landed", "items landed"), ("multiplied", "warp 0 multiplied"),
                ("streamed", "streamed"), ("partials", "partials stored"), ("end", "end"))),
}
POINT = re.compile(r"\[ fused trace \] (\S.*?)\s+(-?[\d.]+)\s+(-?[\d.]+)\s+(-?[\d.]+)\s*$")
TIMER = re.compile(r"\[ fused trace \] global timer: first entry (\d+) ns, last stamp (\d+) ns")


def parse(lines, kernel="chained"):
    """The traces of `kernel` (a key of KERNELS) of rank 0, in the order printed."""
    header_of = re.compile(r"\[ fused trace \] rank (\d+), " + re.escape(KERNELS[kernel][0]))
    any_header = re.compile(r"\[ fused trace \] rank (\d+), ")
    traces, current = [], None
    for line in lines:
        if any_header.search(line):
            header = header_of.search(line)
            current = ({"rank": 0, "points": {}} if header and header.group(1) == "0" else None)
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


def timeline(traces, kernel="chained"):
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
        for key, name in KERNELS[kernel][1]:
            if name in at:
                row[key + "_median"] = round(at[name][1], 2)
                row[key + "_max"] = round(at[name][2], 2)
        # What passes between tails: from the previous tail's last block to this one's first
        # dependent point (N for the chained path, the inputs for the decode kernel).
        first = "n_ready" if kernel == "chained" else "inputs"
        if rows and first + "_median" in row and "end_max" in rows[-1]:
            row[first + "_after_previous_end"] = round(row[first + "_median"] - rows[-1]["end_max"], 2)
            if kernel == "decode" and "released_median" in row:  # where the trace has the release
                row["released_after_previous_end"] = round(row["released_median"] - rows[-1]["end_max"], 2)
        if rows and "end_median" in row and "end_median" in rows[-1]:
            row["period"] = round(row["end_median"] - rows[-1]["end_median"], 2)
        if kernel == "decode":
            # Where the trace has the points, the product splits into warp 0's wait for its items,
            # its multiplies, and the rest of the block to the barrier after them; the read of the
            # inputs after griddepcontrol.wait's release shows; and the finish splits into the
            # partials' stores with the barrier after them, then the sums and outputs.
            for phase, start, stop in (("read", "released", "inputs"),
                                       ("norm", "inputs", "normed"), ("product", "normed", "streamed"),
                                       ("finish", "streamed", "end"), ("wait", "normed", "landed"),
                                       ("mma", "landed", "multiplied"),
                                       ("barrier", "multiplied", "streamed"),
                                       ("stores", "streamed", "partials"), ("sums", "partials", "end")):
                if start + "_median" in row and stop + "_median" in row:
                    row[phase] = round(row[stop + "_median"] - row[start + "_median"], 2)
        rows.append(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", nargs="?", help="the run's output (standard input if omitted)")
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="chained",
                        help="whose traces to read (default: the chained up-projection's)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    text = open(args.log).read() if args.log else sys.stdin.read()
    rows = timeline(parse(text.splitlines(), args.kernel), args.kernel)
    if not rows:
        sys.exit(f"tail_timeline: no {KERNELS[args.kernel][0]} trace with a global timer line found")
    if args.kernel == "chained":
        columns = [("tail", "tail"), ("entry_median", "entry"), ("n_ready_median", "N ready"),
                   ("multiplied_median", "multiplied"), ("multiplied_max", "(last)"),
                   ("end_median", "end"), ("end_max", "(last)"),
                   ("n_ready_after_previous_end", "N after prev. last end"), ("period", "period")]
    else:
        columns = [("tail", "tail"), ("entry_median", "entry"), ("inputs_median", "inputs"),
                   ("normed_median", "N"), ("streamed_median", "product end"), ("end_median", "end"),
                   ("end_max", "(last)"), ("inputs_after_previous_end", "inputs after prev. last end"),
                   ("released_after_previous_end", "(released"), ("read", "read)"),
                   ("norm", "norm"), ("product", "product"), ("wait", "(wait"), ("mma", "mma"),
                   ("barrier", "barrier)"), ("finish", "finish"), ("stores", "(stores"),
                   ("sums", "sums)"), ("period", "period")]
    print("  ".join(f"{title:>10}" for _, title in columns) + "   (µs)")
    for row in rows:
        print("  ".join(f"{row[key]:>10}" if key in row else f"{'–':>10}" for key, _ in columns))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
