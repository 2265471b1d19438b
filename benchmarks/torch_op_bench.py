#!/usr/bin/env python3
"""The tail as a torch op (lmoe.torch.LatentTail), the same tail called from C++ (`lmoe bench`) and
the same math written plainly in PyTorch, timed in one run on one GPU (tp 1, Kimi-K3 dims).

    PYTHONPATH=SITE python3 benchmarks/torch_op_bench.py --lmoe build/cuda/lmoe --json op.json

Every figure is per tail inside CUDA graphs that run --layers tails back to back, each tail with its
own weights, `shared` and output (as `lmoe bench --layers`): the replay's own launch is paid once
per graph, as in a model's graph. Each timed iteration is one replay between CUDA events; the table
shows the median over --iters replays divided by --layers.
  op       lmoe.torch.LatentTail(tier="auto"), the tier the policy picks (the column tier overwrites
           `shared`: replays then run on its leftovers, which changes no timing)
  bench    `lmoe bench --backend cuda -n 1 --comm p2p --mode graph --layers N`, its row for the
           same tier (one rank over p2p, as the op runs it: capturable, no peers)
  torch    F.rms_norm + torch.mm + add, and F.rms_norm + torch.addmm; the faster of the two
The op's outputs are checked against the PyTorch ones at the contract's test tolerance first.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.nn.functional as F

import lmoe.torch
from graph_timing import check_timing_args, parse_token_list, time_graph


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=7168)
    p.add_argument("--d-latent", type=int, default=3584)
    p.add_argument("-t", "--tokens", default="1,16,128,1024,8192")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--lmoe", help="the lmoe binary for the C++ rows (omitted: no bench rows)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    args.token_list = parse_token_list(p, args.tokens)
    check_timing_args(p, args)
    return args


def bench_rows(args):
    """{(T, tier): median µs per tail} from `lmoe bench`."""
    if not args.lmoe:
        return {}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "bench.json")
        command = [args.lmoe, "bench", "--backend", "cuda", "-n", "1", "--comm", "p2p", "--mode", "graph",
                   "--layers", str(args.layers), "--d-model", str(args.d_model), "--d-latent",
                   str(args.d_latent), "-t", args.tokens, "--warmup", str(args.warmup), "--iters",
                   str(args.iters), "--no-check", "--json", path]
        print("+", " ".join(command), flush=True)
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        with open(path) as f:
            doc = json.load(f)
    rows = {}
    for record in doc["records"]:
        if record.get("median_us") is not None:
            key = (record["tokens"], record["tier"])
            rows[key] = min(rows.get(key, record["median_us"]), record["median_us"])
    return rows


def main():
    args = parse_args()
    d, l, dtype, eps = args.d_model, args.d_latent, torch.bfloat16, 1e-5
    max_t = max(args.token_list)
    generator = torch.Generator(device="cuda").manual_seed(2026)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=generator) * scale).to(dtype)

    gammas = [randn(l, scale=0.1) + 1 for _ in range(args.layers)]
    weights = [randn(d, l, scale=l ** -0.5) for _ in range(args.layers)]
    tails = [lmoe.torch.LatentTail(d, l, dtype=dtype, eps=eps, max_tokens=max_t).load_weights(g, w)
             for g, w in zip(gammas, weights)]
    bench = bench_rows(args)
    results = []
    print(f"{'T':>6} {'tier':>8} {'op us':>9} {'bench us':>9} {'torch us':>9} {'op/torch':>9}"
          f" {'op-bench':>9}", flush=True)
    for tokens in args.token_list:
        routed = randn(tokens, l)
        shared = [randn(tokens, d, scale=0.5) for _ in range(args.layers)]
        shared_in = [s.clone() for s in shared]  # the op's: the column tier overwrites it
        outs = [None] * args.layers
        tier = tails[0].decide(tokens)

        def op_body():
            for i, tail in enumerate(tails):
                outs[i] = tail(routed, shared_in[i], gammas[i], weights[i])

        def torch_mm_body():
            for i in range(args.layers):
                normed = F.rms_norm(routed, (l,), gammas[i], eps)
                outs[i] = torch.mm(normed, weights[i].t()) + shared[i]

        def torch_addmm_body():
            for i in range(args.layers):
                normed = F.rms_norm(routed, (l,), gammas[i], eps)
                outs[i] = torch.addmm(shared[i], normed, weights[i].t())

        op_body()
        got = [o.float() for o in outs]
        torch_mm_body()
        for i in range(args.layers):
            torch.testing.assert_close(got[i], outs[i].float(), atol=8e-2, rtol=3e-2)
        op_us = time_graph(op_body, args.layers, args.warmup, args.iters)
        torch_us = min(time_graph(torch_mm_body, args.layers, args.warmup, args.iters),
                       time_graph(torch_addmm_body, args.layers, args.warmup, args.iters))
        bench_us = bench.get((tokens, tier))
        row = {"tokens": tokens, "tier": tier, "op_us": op_us, "bench_us": bench_us,
               "torch_us": torch_us, "op_over_torch": op_us / torch_us,
               "op_minus_bench_us": None if bench_us is None else op_us - bench_us}
        results.append(row)
        bench_text = "-" if bench_us is None else f"{bench_us:9.1f}"
        diff_text = "-" if bench_us is None else f"{op_us - bench_us:+9.2f}"
        print(f"{tokens:>6} {tier:>8} {op_us:9.1f} {bench_text:>9} {torch_us:9.1f}"
              f" {op_us / torch_us:9.2f} {diff_text:>9}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "d_model": d, "d_latent": l, "dtype": "bf16", "layers": args.layers,
                       "iters": args.iters, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
