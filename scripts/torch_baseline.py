#!/usr/bin/env python3
"""The reference system's `overlap` and `column` tails written plainly in PyTorch
(torch.distributed all-reduce + torch.mm), timed on the same GPUs as `lmoe bench` for a side-by-side
comparison, and dumping inputs/outputs as safetensors so that `lmoe tail` can be checked against it.

    torchrun --nproc_per_node=8 scripts/torch_baseline.py -t 1,16,128,1024,8192 --json base.json
    torchrun --nproc_per_node=8 scripts/torch_baseline.py -t 64 --dump-dir DIR   # DIR/t64_input.safetensors,
                                                                                    # DIR/t64_overlap.safetensors, ...
    python3 scripts/compare_safetensors.py DIR/t64_overlap.safetensors OUT_FROM_LMOE.safetensors

Per rank r (tp ranks, stripe s = d / tp):
  overlap: latent = AR(routed_r); N = rmsnorm(latent) (fp32 math, cast back); up = N · w_upᵀ (full width);
           shared_sum = AR(shared_r) on a side stream, overlapped with the norm and the GEMM; y = up + shared_sum
  column:  latent = AR(routed_r); N = rmsnorm(latent); shared_r[:, rs:(r+1)s] += N · w_up[rs:(r+1)s]ᵀ (addmm);
           y = AR(shared_r)
Times: CUDA events around each iteration on each rank, the slowest rank's time per iteration, then the
median / p10 / p90 over iterations (as `lmoe bench` reports). --graph captures one forward per (T, tier) in
a CUDA graph (NCCL collectives included) and replays it. --device cpu runs on the CPU with gloo (a
self-test of the script, not a baseline; tests/cli/test_torch_baseline.py runs it against `lmoe tail`):
bf16 and f16 there need a torch whose gloo all-reduces them and whose CPU matmul takes them (Debian's
torch 1.13 does neither: --dtype f32), which the script checks before any work. Without torchrun, start
each rank with MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE set (the env:// rendezvous).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
PRESETS = {"kimi-k3": (7168, 3584), "small": (384, 192)}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="kimi-k3", choices=sorted(PRESETS))
    p.add_argument("--d-model", type=int, help="hidden size d (overrides the preset)")
    p.add_argument("--d-latent", type=int, help="latent size l (overrides the preset)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--eps", type=float, default=1e-5)
    p.add_argument("-t", "--tokens", default="1,16,128,1024,8192", help="comma-separated T values")
    p.add_argument("--tiers", default="overlap,column", help="comma-separated: overlap, column")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--graph", action="store_true", help="capture each forward in a CUDA graph and replay it")
    p.add_argument("--cold-l2", action="store_true",
                   help="evict the GPU's L2 before each timed iteration (outside the timed span), as `lmoe bench --cold-l2`")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--json", help="write the results to this file (rank 0)")
    p.add_argument("--dump-dir", help="write each T's inputs and each tier's output as safetensors (rank 0)")
    args = p.parse_args()
    d, l = PRESETS[args.preset]
    args.d = args.d_model or d
    args.l = args.d_latent or l
    try:
        args.token_list = [int(x) for x in args.tokens.split(",") if x]
    except ValueError:
        p.error(f"--tokens: expected comma-separated integers, got '{args.tokens}'")
    if not args.token_list or min(args.token_list) < 1:
        p.error("--tokens: every T must be >= 1")
    args.tier_list = [x for x in args.tiers.split(",") if x]
    for tier in args.tier_list:
        if tier not in ("overlap", "column"):
            p.error(f"--tiers: unknown tier '{tier}' (overlap, column)")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    if args.cold_l2 and args.device != "cuda":
        p.error("--cold-l2 needs --device cuda (it evicts a GPU's L2)")
    return args


def rmsnorm(x, gamma, eps):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * gamma).to(x.dtype)


class Rank:
    """One rank's inputs for one T and its forwards."""

    def __init__(self, args, tokens, rank, tp, device):
        dtype = DTYPES[args.dtype]
        d, l = args.d, args.l
        if d % tp:
            raise SystemExit(f"d_model={d} is not divisible by tp={tp}")
        # The same weights on every rank (one generator per tensor, seeded alike); partials per rank.
        g = torch.Generator().manual_seed(args.seed)
        self.gamma = (1.0 + 0.1 * torch.randn(l, generator=g)).to(dtype)
        self.w_up = (torch.randn(d, l, generator=g) / l**0.5).to(dtype)
        self.routed_all = torch.randn(tp, tokens, l, generator=g).to(dtype)
        self.shared_all = torch.randn(tp, tokens, d, generator=g).to(dtype)
        self.gamma_f = self.gamma.float().to(device)
        self.w = self.w_up.to(device)
        self.routed = self.routed_all[rank].to(device)
        self.shared_in = self.shared_all[rank].to(device)
        self.eps = args.eps
        self.rank, self.tp, self.s = rank, tp, d // tp
        # Persistent buffers (a captured graph replays on the same addresses).
        self.latent = torch.empty_like(self.routed)
        self.shared = torch.empty_like(self.shared_in)
        self.shared_sum = torch.empty_like(self.shared_in)
        self.out = torch.empty_like(self.shared_in)
        self.side = torch.cuda.Stream() if device.type == "cuda" else None

    def overlap(self):
        self.latent.copy_(self.routed)
        dist.all_reduce(self.latent)
        self.shared_sum.copy_(self.shared_in)
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.side):
                dist.all_reduce(self.shared_sum)
        else:
            dist.all_reduce(self.shared_sum)
        up = torch.mm(rmsnorm(self.latent, self.gamma_f, self.eps), self.w.t())
        if self.side is not None:
            torch.cuda.current_stream().wait_stream(self.side)
        torch.add(up, self.shared_sum, out=self.out)

    def column(self):
        self.latent.copy_(self.routed)
        dist.all_reduce(self.latent)
        normed = rmsnorm(self.latent, self.gamma_f, self.eps)
        lo, hi = self.rank * self.s, (self.rank + 1) * self.s
        self.shared.copy_(self.shared_in)
        stripe = self.shared[:, lo:hi]
        stripe.copy_(torch.addmm(stripe, normed, self.w[lo:hi].t()))
        dist.all_reduce(self.shared)
        self.out.copy_(self.shared)


def check_cpu_dtype(dtype):
    """On the CPU, whether this torch's gloo all-reduces `dtype` and its matmul takes it: a clear
    error on every rank before any work, where the first forward would fail with "Invalid scalar type"."""
    probe = torch.ones(2, 2, dtype=dtype)
    try:
        dist.all_reduce(probe[0].clone())
        torch.mm(probe, probe)
    except RuntimeError as e:
        raise SystemExit(f"--device cpu: torch {torch.__version__} cannot run {dtype} on the CPU with gloo ({e}); "
                         "use --dtype f32")


def l2_evictor(device):
    """A write of max(2 × L2, 64 MiB) bytes that leaves none of the forward's data in L2 (lmoe bench's
    --cold-l2 writes the same amount, docs/bench.md)."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0
    buffer = torch.empty(max(2 * l2, 64 << 20), dtype=torch.uint8, device=device)
    return buffer.zero_


def timed(fn, args, device):
    """Seconds of each timed iteration on this rank (with --cold-l2, L2 evicted before each, untimed)."""
    for _ in range(args.warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(args.iters):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return times
    evict = l2_evictor(device) if args.cold_l2 else None
    torch.cuda.synchronize()
    dist.barrier()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
    stops = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters)]
    for i in range(args.iters):
        if evict is not None:
            evict()
        starts[i].record()
        fn()
        stops[i].record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e-3 for a, b in zip(starts, stops)]


def captured(fn, args):
    """fn captured in a CUDA graph (after eager warm-up on a side stream, as PyTorch requires)."""
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        for _ in range(max(1, args.warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def percentile(sorted_values, q):
    return sorted_values[min(len(sorted_values) - 1, int(q * (len(sorted_values) - 1) + 0.5))]


def main():
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, tp = dist.get_rank(), dist.get_world_size()
    if device.type == "cpu":
        check_cpu_dtype(DTYPES[args.dtype])
    records = []
    if rank == 0:
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"# torch baseline: d {args.d}, l {args.l}, {args.dtype}, tp {tp}, {gpu}, torch {torch.__version__}, "
              f"{'graph' if args.graph else 'eager'}{', L2 evicted before each' if args.cold_l2 else ''}, "
              f"{args.warmup} warm-up + {args.iters} timed iterations")
        print(f"{'T':>6} {'tier':>8} {'mode':>6} {'median_us':>10} {'p10_us':>9} {'p90_us':>9}")
    for tokens in args.token_list:
        state = Rank(args, tokens, rank, tp, device)
        if args.dump_dir and rank == 0:
            from safetensors.torch import save_file
            os.makedirs(args.dump_dir, exist_ok=True)
            save_file({"routed": state.routed_all.contiguous(), "shared": state.shared_all.contiguous(),
                       "norm.weight": state.gamma.contiguous(), "up_proj.weight": state.w_up.contiguous()},
                      os.path.join(args.dump_dir, f"t{tokens}_input.safetensors"), metadata={"eps": repr(args.eps)})
        for tier in args.tier_list:
            fn = getattr(state, tier)
            if args.graph and device.type == "cuda":
                fn = captured(fn, args)
            mine = timed(fn, args, device)
            everyone = [None] * tp
            dist.all_gather_object(everyone, mine)
            slowest = sorted(max(ranks) for ranks in zip(*everyone))
            record = {"tokens": tokens, "tier": tier, "mode": "graph" if args.graph else "eager",
                      "median_us": statistics.median(slowest) * 1e6, "p10_us": percentile(slowest, 0.1) * 1e6,
                      "p90_us": percentile(slowest, 0.9) * 1e6}
            records.append(record)
            # The output of the last forward, for a cross-check against lmoe on the same input.
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if args.dump_dir and rank == 0:
                from safetensors.torch import save_file
                save_file({"output": state.out.cpu().contiguous()},
                          os.path.join(args.dump_dir, f"t{tokens}_{tier}.safetensors"),
                          metadata={"producer": "torch_baseline", "tier": tier})
            if rank == 0:
                print(f"{tokens:>6} {tier:>8} {record['mode']:>6} {record['median_us']:>10.1f} "
                      f"{record['p10_us']:>9.1f} {record['p90_us']:>9.1f}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"tool": "torch_baseline", "torch": torch.__version__, "tp": tp, "d_model": args.d,
                       "d_latent": args.l, "dtype": args.dtype, "eps": args.eps, "cold_l2": args.cold_l2,
                       "warmup": args.warmup,
                       "iters": args.iters, "command": " ".join(sys.argv), "records": records}, f, indent=1)
    # Every result is written; leave without tearing NCCL down: destroy_process_group() with captured
    # graphs still holding its communicators hung past 300 s after a complete run on two H200s.
    sys.stdout.flush()
    sys.stderr.flush()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
        os._exit(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
