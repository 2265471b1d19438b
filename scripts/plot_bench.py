#!/usr/bin/env python3
"""Plots tail latency against T for every tier, from `lmoe bench --json` or a tier table written by
`lmoe tune` (version 2 or 3), on log axes: each tier's median with its p10-p90 band, the tier the policy
chose at each T, and physical floors:

  comm floor  = the fewest bytes any tier sends per rank at T / the link bandwidth
  GEMM floor  = the fewest up-projection FLOPs any tier does per rank at T / the GEMM rate
  GPU floor   = the lowest of the tiers' floors that `lmoe bench` recorded at T (its floor_us: links,
                memory and GEMM at the GPU's rates, docs/bench.md), where the file has them

The bandwidth and the rate are --link-gbps and --gemm-tflops when given (e.g. busbw from nccl-tests,
TFLOP/s from lmoe_kernel_bench); otherwise the best the sweep itself reached (bytes or FLOPs of a
run / its median, maximized over every run), so that no measured point lies below its floor.

matplotlib is needed only to draw: `python3 -m pip install matplotlib`. The data preparation
(`prepare`) and `--print` work without it.

Usage: scripts/plot_bench.py bench.json --output bench.png [--comm nccl]
"""

import argparse
import json
import sys

TIERS = ["fused", "overlap", "column", "token"]
ESIZE = {"bf16": 2, "f16": 2, "f32": 4}


def bus_bytes(tier, tokens, d_model, d_latent, dtype, tp):
    """Bytes each rank sends in `tier` (include/lmoe/tail_bench.hpp, tier_bus_bytes)."""
    row = tokens * ESIZE[dtype]
    share = (tp - 1) / tp
    if tier in ("overlap", "column"):
        return 2 * share * row * d_latent + 2 * share * row * d_model
    if tier == "token":
        return share * row * d_latent + 2 * share * row * d_model
    if tier == "fused":
        return (tp - 1) * row * d_latent + 2 * share * row * d_model
    raise ValueError(f"unknown tier {tier!r}")


def gemm_flops(tier, tokens, d_model, d_latent, tp):
    """Up-projection FLOPs per rank: overlap computes the full width, the others a 1/tp share."""
    full = 2.0 * tokens * d_model * d_latent
    return full if tier == "overlap" else full / tp


def _recorded_floors(doc, comm):
    """The lowest recorded floor_us of any tier at each T of `comm` (lmoe bench's floors), or None
    when the file has none (older files, ranks sharing a GPU, no rates known)."""
    lowest = {}
    for record in doc["records"]:
        floor = record.get("floor")
        if record["comm"] == comm and floor:
            t = record["tokens"]
            lowest[t] = min(lowest.get(t, floor["floor_us"]), floor["floor_us"])
    return lowest or None


def _series_from_bench(doc, comm):
    comms = doc.get("comms") or sorted({r["comm"] for r in doc["records"]})
    if comm is None:
        comm = comms[0]
    if comm not in comms:
        raise ValueError(f"comm {comm!r} is not in this file (it has {', '.join(comms)})")
    points = {}
    for record in doc["records"]:
        if record["comm"] != comm:
            continue
        entry = points.setdefault(record["tokens"], {"chosen": None, "tiers": {}})
        if record["status"] == "ran":
            entry["tiers"][record["tier"]] = (record["median_us"], record["p10_us"], record["p90_us"])
            if record["chosen"]:
                entry["chosen"] = record["tier"]
    setting = {
        "preset": doc.get("preset", ""),
        "d_model": doc["d_model"],
        "d_latent": doc["d_latent"],
        "dtype": doc["dtype"],
        "tp": doc["tp"],
        "backend": doc.get("backend", ""),
        "gpu": (doc.get("gpu") or {}).get("name"),
        "date": doc.get("date", ""),
        "mode": next((r["mode"] for r in doc["records"] if r["comm"] == comm and r["status"] == "ran"), ""),
    }
    return comm, points, setting


def _series_from_table(doc, comm):
    p = doc["provenance"]
    if comm is not None and comm != p["comm"]:
        raise ValueError(f"comm {comm!r}: this table was measured with {p['comm']!r}")
    points = {}
    for point in doc["grid"]:
        tiers = {}
        for tier, timing in point["tiers"].items():
            if "median_us" in timing:
                tiers[tier] = (timing["median_us"], timing["p10_us"], timing["p90_us"])
        points[point["tokens"]] = {"chosen": point.get("chosen"), "tiers": tiers}
    setting = {
        "preset": p.get("preset", ""),
        "d_model": p["dims"]["d_model"],
        "d_latent": p["dims"]["d_latent"],
        "dtype": p["dtype"],
        "tp": p["tp"],
        "backend": p["backend"],
        "gpu": (p.get("gpu") or {}).get("name"),
        "date": p.get("date", ""),
        "mode": p.get("mode", ""),
    }
    return p["comm"], points, setting


def prepare(doc, comm=None, link_gbps=None, gemm_tflops=None):
    """What the plot shows, as plain lists: per tier the T, medians, p10 and p90 (microseconds);
    the chosen tier's points; the floors and where their rates came from."""
    if doc.get("format") == "lmoe-tier-table":
        if doc.get("version") not in (2, 3):
            raise ValueError("a tier table of version 2 or 3 (from `lmoe tune`) is needed: it has the measurements")
        comm, points, s = _series_from_table(doc, comm)
    elif doc.get("command") == "bench":
        comm, points, s = _series_from_bench(doc, comm)
    else:
        raise ValueError("expected the JSON of `lmoe bench --json` or a tier table from `lmoe tune`")
    if not points:
        raise ValueError(f"no measurements for comm {comm!r}")

    d, l, dtype, tp = s["d_model"], s["d_latent"], s["dtype"], s["tp"]
    tokens = sorted(points)
    tiers = {}
    for tier in TIERS:
        runs = [(t, *points[t]["tiers"][tier]) for t in tokens if tier in points[t]["tiers"]]
        if runs:
            tiers[tier] = {
                "tokens": [r[0] for r in runs],
                "median_us": [r[1] for r in runs],
                "p10_us": [r[2] for r in runs],
                "p90_us": [r[3] for r in runs],
            }
    chosen = {"tokens": [], "tier": [], "median_us": []}
    for t in tokens:
        tier = points[t]["chosen"]
        if tier and tier in points[t]["tiers"]:
            chosen["tokens"].append(t)
            chosen["tier"].append(tier)
            chosen["median_us"].append(points[t]["tiers"][tier][0])

    # The best rate each resource reached in the sweep: bytes (or FLOPs) of a run / its median.
    runs = [(t, tier, m) for t in tokens for tier, (m, _, _) in points[t]["tiers"].items() if m > 0]
    link_source = gemm_source = "given"
    if link_gbps is None and tp > 1 and runs:
        link_gbps = max(bus_bytes(tier, t, d, l, dtype, tp) / (m * 1e-6) for t, tier, m in runs) * 1e-9
        link_source = "best busbw in this sweep"
    if gemm_tflops is None and runs:
        gemm_tflops = max(gemm_flops(tier, t, d, l, tp) / (m * 1e-6) for t, tier, m in runs) * 1e-12
        gemm_source = "best up-projection rate in this sweep"
    floors = {"tokens": tokens, "link_gbps": link_gbps, "link_source": link_source,
              "gemm_tflops": gemm_tflops, "gemm_source": gemm_source, "comm_us": None, "gemm_us": None,
              "gpu_us": None, "gpu_rates": None}
    recorded = _recorded_floors(doc, comm) if doc.get("command") == "bench" else None
    if recorded:
        floors["gpu_us"] = [recorded.get(t) for t in tokens]
        floors["gpu_rates"] = doc.get("floor_rates")
    if link_gbps and tp > 1:
        floors["comm_us"] = [min(bus_bytes(x, t, d, l, dtype, tp) for x in TIERS) / (link_gbps * 1e9) * 1e6
                             for t in tokens]
    if gemm_tflops:
        floors["gemm_us"] = [min(gemm_flops(x, t, d, l, tp) for x in TIERS) / (gemm_tflops * 1e12) * 1e6
                             for t in tokens]

    where = s["gpu"] or s["backend"]
    title = (f"lmoe tail: {s['preset']} (d {d}, l {l}, {dtype}), tp {tp}, comm {comm}"
             f"{', ' + s['mode'] if s['mode'] else ''} — {where}, {s['date'][:10]}")
    return {"title": title, "comm": comm, "tiers": tiers, "chosen": chosen, "floors": floors}


def draw(data, output):
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot_bench.py: matplotlib is not installed; install it with `python3 -m pip install matplotlib`")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = {"fused": "tab:red", "overlap": "tab:orange", "column": "tab:blue", "token": "tab:green"}
    fig, ax = plt.subplots(figsize=(9, 6))
    for tier, series in data["tiers"].items():
        ax.plot(series["tokens"], series["median_us"], marker="o", ms=3, lw=1.5, color=colors[tier], label=tier)
        ax.fill_between(series["tokens"], series["p10_us"], series["p90_us"], color=colors[tier], alpha=0.15, lw=0)
    chosen = data["chosen"]
    if chosen["tokens"]:
        ax.scatter(chosen["tokens"], chosen["median_us"], s=90, facecolors="none", edgecolors="black",
                   linewidths=1.2, zorder=5, label="chosen by the policy")
    floors = data["floors"]
    if floors["comm_us"]:
        ax.plot(floors["tokens"], floors["comm_us"], ls="--", color="gray",
                label=f"comm floor: bytes / {floors['link_gbps']:.3g} GB/s ({floors['link_source']})")
    if floors["gemm_us"]:
        ax.plot(floors["tokens"], floors["gemm_us"], ls=":", color="black",
                label=f"GEMM floor: FLOPs / {floors['gemm_tflops']:.3g} TFLOP/s ({floors['gemm_source']})")
    if floors["gpu_us"]:
        rates = floors["gpu_rates"] or {}
        said = ", ".join(f"{name} {rates[key]:g} {unit}" for name, key, unit in
                         [("link", "link_gbps", "GB/s"), ("memory", "memory_gbps", "GB/s"),
                          ("GEMM", "gemm_tflops", "TFLOP/s")] if key in rates)
        points = [(t, f) for t, f in zip(floors["tokens"], floors["gpu_us"]) if f is not None]
        ax.plot([t for t, _ in points], [f for _, f in points], ls="-.", color="purple",
                label=f"GPU floor (lmoe bench{': ' + said if said else ''})")
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:g}"))
    ax.set_yscale("log")
    ax.set_xlabel("T (tokens)")
    ax.set_ylabel("time per forward (µs, median; band p10–p90)")
    ax.set_title(data["title"], fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=130)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Plot tail latency against T per tier (log axes) with the policy's choice and the "
        "physical floors, from `lmoe bench --json` output or an `lmoe tune` tier table. "
        "Drawing needs matplotlib (`python3 -m pip install matplotlib`).")
    parser.add_argument("input", help="bench JSON (lmoe bench --json) or tier table (lmoe tune --output)")
    parser.add_argument("-o", "--output", help="PNG to write (default: INPUT with .png)")
    parser.add_argument("--comm", help="which comm of a bench file (default: its first)")
    parser.add_argument("--link-gbps", type=float, help="link bandwidth for the comm floor, GB/s (default: the best busbw of the sweep)")
    parser.add_argument("--gemm-tflops", type=float, help="GEMM rate for the FLOPs floor, TFLOP/s (default: the best rate of the sweep)")
    parser.add_argument("--print", action="store_true", help="print the prepared data as JSON instead of drawing")
    args = parser.parse_args(argv)
    with open(args.input) as f:
        doc = json.load(f)
    try:
        data = prepare(doc, args.comm, args.link_gbps, args.gemm_tflops)
    except (ValueError, KeyError) as error:
        sys.exit(f"plot_bench.py: {args.input}: {error}")
    if args.print:
        json.dump(data, sys.stdout, indent=1)
        print()
        return
    output = args.output or (args.input[:-5] if args.input.endswith(".json") else args.input) + ".png"
    draw(data, output)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
