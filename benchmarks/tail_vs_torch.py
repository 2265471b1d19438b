#!/usr/bin/env python3
"""The tail with one rank (tp 1, as an expert-parallel deployment runs it on each GPU) in lmoe and in
plain PyTorch, timed in one run on one GPU, with the floor measured in the same run.

    python3 benchmarks/tail_vs_torch.py --lmoe build/cuda/lmoe --json tp1.json --markdown tp1.md

Per T, warm and cold L2 (cold: a buffer twice the L2 written before each timed replay, outside it):
  lmoe     `lmoe bench --backend cuda -n 1 --comm p2p --mode graph --layers N --check-table`: every
           tier, the one the built-in policy picks and the fastest
  torch    F.rms_norm + torch.mm + add, and F.rms_norm + torch.addmm into `shared`: the faster
  floor    the larger of the GEMM at this run's 8192³ torch.mm rate and the tail's bytes (w_up, the
           routed latent, `shared` and the output) at this run's device-copy rate
Every figure is the median µs per tail over --iters replays of a graph of --layers tails (each with
its own weights, `shared` and output), as `lmoe bench --layers` times lmoe's.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

from graph_timing import check_timing_args, l2_flush_buffer, measured_rates, parse_token_list, time_graph


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=7168)
    p.add_argument("--d-latent", type=int, default=3584)
    p.add_argument("-t", "--tokens", default="1,4,16,64,128,256,1024,4096,8192,16384,32768")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--lmoe", required=True, help="the lmoe binary")
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--markdown", help="write the table here")
    args = p.parse_args()
    args.token_list = parse_token_list(p, args.tokens)
    check_timing_args(p, args)
    return args


def lmoe_rows(args, cold):
    """{T: {tier: median µs}, and "chosen": the policy's tier} from `lmoe bench --check-table`."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "bench.json")
        command = [args.lmoe, "bench", "--backend", "cuda", "-n", "1", "--comm", "p2p", "--mode",
                   "graph", "--layers", str(args.layers), "--d-model", str(args.d_model),
                   "--d-latent", str(args.d_latent), "-t", args.tokens, "--warmup",
                   str(args.warmup), "--iters", str(args.iters), "--check-table", "--check-max-tokens", "128",
                   "--json", path]
        if cold:
            command.append("--cold-l2")
        print("+", " ".join(command), flush=True)
        completed = subprocess.run(command, stdout=subprocess.PIPE, text=True)
        print(completed.stdout[-3000:], flush=True)
        with open(path) as f:
            doc = json.load(f)
    rows = {}
    for record in doc["records"]:
        row = rows.setdefault(record["tokens"], {})
        if record.get("median_us") is not None:
            row[record["tier"]] = record["median_us"]
        if record.get("chosen"):
            row["chosen"] = record["tier"]
    return rows, completed.returncode


def torch_rows(args, cold):
    d, l, dtype, eps = args.d_model, args.d_latent, torch.bfloat16, 1e-5
    gen = torch.Generator(device="cuda").manual_seed(2026)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)

    gammas = [randn(l, scale=0.1) + 1 for _ in range(args.layers)]
    weights = [randn(d, l, scale=l ** -0.5) for _ in range(args.layers)]
    flush = l2_flush_buffer() if cold else None
    rows = {}
    for tokens in args.token_list:
        routed = [randn(tokens, l) for _ in range(args.layers)]
        shared = [randn(tokens, d, scale=0.5) for _ in range(args.layers)]
        outs = [torch.empty(tokens, d, device="cuda", dtype=dtype) for _ in range(args.layers)]

        def mm_add():
            for i in range(args.layers):
                normed = F.rms_norm(routed[i], (l,), gammas[i], eps)
                torch.add(torch.mm(normed, weights[i].t()), shared[i], out=outs[i])

        def addmm():
            for i in range(args.layers):
                normed = F.rms_norm(routed[i], (l,), gammas[i], eps)
                shared[i].addmm_(normed, weights[i].t())

        rows[tokens] = {"mm_add": time_graph(mm_add, args.layers, args.warmup, args.iters, flush),
                        "addmm": time_graph(addmm, args.layers, args.warmup, args.iters, flush)}
        print(f"torch T={tokens} {'cold' if cold else 'warm'}: {rows[tokens]}", flush=True)
        del routed, shared, outs
        torch.cuda.empty_cache()
    return rows


def main():
    args = parse_args()
    tflops, copy_gbs = measured_rates()
    print(f"rates: GEMM {tflops:.1f} TFLOP/s, device copy {copy_gbs:.0f} GB/s", flush=True)
    d, l = args.d_model, args.d_latent
    results, failed = [], False
    for cold in (False, True):
        lmoe, rc = lmoe_rows(args, cold)
        failed |= rc != 0
        theirs = torch_rows(args, cold)
        for tokens in args.token_list:
            mine = lmoe.get(tokens, {})
            tiers = {k: v for k, v in mine.items() if k != "chosen"}
            chosen = mine.get("chosen")
            fastest = min(tiers, key=tiers.get) if tiers else None
            torch_way = min(theirs[tokens], key=theirs[tokens].get)
            floor_us = max(2 * tokens * d * l / tflops / 1e6,
                           2 * (d * l + tokens * l + 2 * tokens * d) / copy_gbs / 1e3)
            row = {"tokens": tokens, "l2": "cold" if cold else "warm", "lmoe_tiers_us": tiers,
                   "policy_tier": chosen, "policy_us": tiers.get(chosen), "fastest_tier": fastest,
                   "fastest_us": tiers.get(fastest), "torch_us": theirs[tokens],
                   "torch_way": torch_way, "torch_best_us": theirs[tokens][torch_way],
                   "floor_us": floor_us}
            results.append(row)
    header = ("| L2 | T | lmoe, the policy's tier | lmoe, its fastest tier | PyTorch, its faster way |"
              " lmoe / PyTorch | floor | lmoe / floor |\n|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in results:
        pol = r["policy_us"]
        pol_text = "-" if pol is None else f"{pol:.1f} (`{r['policy_tier']}`)"
        fast_text = "-" if r["fastest_us"] is None else f"{r['fastest_us']:.1f} (`{r['fastest_tier']}`)"
        ratio = "-" if pol is None else f"{pol / r['torch_best_us']:.2f}"
        over_floor = "-" if pol is None else f"{pol / r['floor_us']:.2f}"
        lines.append(f"| {r['l2']} | {r['tokens']} | {pol_text} | {fast_text} | "
                     f"{r['torch_best_us']:.1f} ({r['torch_way']}) | {ratio} | {r['floor_us']:.1f} | "
                     f"{over_floor} |")
    table = header + "\n".join(lines) + "\n"
    print(table, flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "d_model": d, "d_latent": l, "dtype": "bf16", "layers": args.layers,
                       "iters": args.iters, "gemm_tflops": tflops, "copy_gbs": copy_gbs,
                       "results": results}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
