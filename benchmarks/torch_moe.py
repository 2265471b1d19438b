#!/usr/bin/env python3
"""The latent MoE layer written plainly in PyTorch, as an engine without an MXFP4 Hopper kernel runs
it on one GPU (bf16 weights), beside `lmoe layer --graph` on the same checkpoint and inputs.

    python3 benchmarks/torch_moe.py --preset kimi-k3 --generate CKPT          # synthetic checkpoint
    python3 benchmarks/torch_moe.py --preset kimi-k3 --experts 112 --generate CKPT   # one GPU's share
    python3 benchmarks/torch_moe.py --preset kimi-k3 --weights CKPT --lmoe build/cuda/lmoe \\
        --json torch_moe.json --markdown torch_moe.md                         # GPU: time both
    python3 benchmarks/torch_moe.py --device cpu --preset small --weights CKPT --check-lmoe DUMP

The forward (src/core/router.cpp and src/cpu/cpu_layer_executor.cpp transcribed):
  router   fp32 logits x·W_gᵀ (no TF32), sigmoid (or softmax) scores, + the fp32 correction bias,
           grouped top-k (a group's score: its two best biased scores summed with a bias, its best
           without), weights the unbiased scores of the chosen experts, renormalized, × scale
  latent   z = x · W_downᵀ (bf16)
  experts  `grouped`: slots sorted by expert, torch._grouped_mm for up (and gate) and down (where
           this torch has it); `loop`: per slot j of k, the chosen experts' matrices gathered and
           torch.bmm (decode only, T ≤ 16: it copies T·k experts' weights); the faster per T is kept;
           routed = Σ_j w_j · o_j in fp32, slot order, rounded once
  shared   act(x·Gᵀ, x·Uᵀ)·Dᵀ
  tail     F.rms_norm (none where the model has no latent norm) + torch.mm + add

The preset's layer (dims, router, activation, eps, tensor names, MXFP4 experts) is read from
`lmoe layer --preset P --scale 1 --describe`, so that src/models/ alone defines it (the binary:
--lmoe, else the newer of build/cuda/lmoe and build/cpu/lmoe). --generate writes a synthetic checkpoint by the
preset's tensor names (`generate_checkpoint`: a torch.Generator from --seed, fan-in scaled normals;
MXFP4 experts where the model stores them so, random e2m1 nibbles with one E8M0 scale per row block)
that `lmoe layer --weights DIR --layer 0` loads. --check-lmoe DIR reads the x, y and routing that
`lmoe layer --dump-dir DIR` wrote, runs x here and compares y on the tokens both routed alike with
the layer's tolerances (docs/layer.md, normwise 1e-2 and row 0.06 in bf16); exit 1 beyond them. With
--lmoe (cuda) the script runs `lmoe layer --graph` itself (warm and --cold-l2, one rank, --dump-dir;
MXFP4 experts kept packed), checks, then times its own forward as CUDA graphs (warm and cold L2, --iters replays, median
µs) and writes the table: both times, their ratio, and two floors measured in the same run (the
active weights' bytes at the device-copy rate, the FLOPs at the bf16 GEMM rate;
benchmarks/tail_vs_torch.py measures both).
"""
import argparse
import glob
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn.functional as F

# The layer's tolerances in bf16 (src/core/layer_reference.cpp: layer_normwise_tolerance, layer_row_tolerance).
NORMWISE_TOLERANCE, ROW_TOLERANCE = 1e-2, 0.06
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
LOOP_MAX_TOKENS = 16


def token_counts(text):
    """"1,16,128" → [1, 16, 128] (argparse's type for -t)."""
    counts = [int(x) for x in text.split(",") if x.isdigit()]
    if len(counts) != len(text.split(",")) or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got '{text}'")
    return counts


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="kimi-k3", help="a preset with a layer, as `lmoe layer --preset` takes")
    p.add_argument("--generate", metavar="DIR", help="write a synthetic checkpoint of the preset's layer 0 here")
    p.add_argument("--seed", type=int, default=2026, help="the generator's seed")
    p.add_argument("--weights", metavar="DIR", help="the checkpoint folder `lmoe layer --weights` reads")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--experts", type=int, default=0,
                   help="routed experts (0: the preset's): --generate writes that many, and lmoe and this script "
                        "load that many (`lmoe layer --experts`); e.g. 112 for Kimi-K3 on one GPU")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--check-lmoe", metavar="DIR", help="compare with what `lmoe layer --dump-dir DIR` wrote")
    p.add_argument("--lmoe", metavar="BINARY",
                   help="the lmoe binary: it describes the preset (`lmoe layer --describe`; without --lmoe, "
                        "the newer of build/cuda/lmoe and build/cpu/lmoe of this repository); given, on cuda it also runs "
                        "`lmoe layer --graph` on the same checkpoint, then times both")
    p.add_argument("-t", "--tokens", dest="token_list", type=token_counts, default="1,16,128,1024,8192")
    p.add_argument("--experts-impl", default="auto", choices=["auto", "grouped", "loop"],
                   help="auto: time both where both run, keep the faster per T")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--markdown", help="write the table here")
    args = p.parse_args()
    if args.generate is None and args.weights is None:
        p.error("give --generate DIR (write a checkpoint) or --weights DIR (read one)")
    if args.device == "cuda" and args.weights and not torch.cuda.is_available():
        p.error("--device cuda: no GPU here (--device cpu runs the self-test with --check-lmoe)")
    if args.lmoe and args.device != "cuda":
        p.error("--lmoe times lmoe and PyTorch on a GPU: it needs --device cuda")
    if args.experts < 0:
        p.error(f"--experts: expected 0 (the preset's) or more, got {args.experts}")
    if args.iters < 1 or args.warmup < 0:
        p.error("--iters must be >= 1 and --warmup >= 0")
    return args


# ---- safetensors, read and written with numpy (no safetensors package needed) --------------------

DTYPES = {"BF16": (np.uint16, torch.bfloat16), "F16": (np.float16, torch.float16),
          "F32": (np.float32, torch.float32), "U8": (np.uint8, torch.uint8)}


def to_bytes(tensor):
    t = tensor.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes(), "BF16"
    name = {torch.float32: "F32", torch.float16: "F16", torch.uint8: "U8"}[t.dtype]
    return t.numpy().tobytes(), name


def write_safetensors(path, tensors, metadata=None):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        raw, dtype = to_bytes(tensors[name])
        header[name] = {"dtype": dtype, "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for blob in blobs:
            f.write(blob)


class Checkpoint:
    """Every tensor of a folder's *.safetensors files (or of the files given), read on demand."""

    def __init__(self, folder, files=None):
        self.where = {}
        files = files or sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            raise SystemExit(f"{folder}: no *.safetensors files")
        for path in files:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            for name, entry in header.items():
                if name != "__metadata__":
                    self.where[name] = (path, 8 + n, entry)

    def __contains__(self, name):
        return name in self.where

    def get(self, name):
        if name not in self.where:
            raise SystemExit(f"checkpoint: no tensor '{name}'")
        path, base, entry = self.where[name]
        begin, end = entry["data_offsets"]
        np_type, torch_type = DTYPES[entry["dtype"]]
        with open(path, "rb") as f:
            f.seek(base + begin)
            raw = f.read(end - begin)
        array = np.frombuffer(raw, dtype=np_type).copy()
        tensor = torch.from_numpy(array)
        if torch_type == torch.bfloat16:
            tensor = tensor.view(torch.int16).view(torch.bfloat16)
        return tensor.reshape(entry["shape"])


# ---- the preset's layer, as lmoe holds it ------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lmoe_binary(given):
    """--lmoe, else the newer of build/cuda/lmoe and build/cpu/lmoe of this repository (a stale one
    could describe a preset as it was)."""
    if given:
        return given
    built = [os.path.join(ROOT, "build", build, "lmoe") for build in ("cuda", "cpu")]
    built = [path for path in built if os.path.exists(path)]
    if built:
        return max(built, key=os.path.getmtime)
    raise SystemExit(f"no lmoe binary: give --lmoe BINARY, or build one (cmake --preset cpu && ninja -C build/cpu "
                     f"lmoe) so that {os.path.join(ROOT, 'build', 'cpu', 'lmoe')} exists")


def describe_preset(lmoe, preset, experts=0):
    """The preset's layer at its own dims (with `experts` routed experts where > 0) from `lmoe layer
    --describe` (src/models/ defines it), in this script's names: d, l, experts, inter, shared (the shared
    experts' total width), act, beta, beta_lin, mxfp4, names (role → tensor name with {layer} and {expert};
    "" where the model has none)."""
    command = [lmoe, "layer", "--preset", preset, "--scale", "1", "--describe"]
    command += ["--experts", str(experts)] if experts > 0 else []
    try:
        completed = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as error:
        raise SystemExit(f"{' '.join(command)}: {error}")
    if completed.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({completed.returncode}): {completed.stderr.strip()}")
    layer = json.loads(completed.stdout)
    router = layer["router"]
    return dict(
        d=layer["d_model"], l=layer["d_latent"], experts=router["num_experts"], top_k=router["top_k"],
        n_group=router["n_group"], topk_group=router["topk_group"], score=router["score"],
        bias=router["correction_bias"], renormalize=router["renormalize"], scale=router["routed_scaling_factor"],
        inter=layer["expert_intermediate"], shared=layer["num_shared_experts"] * layer["shared_intermediate"],
        act=layer["activation"], beta=layer["activation_beta"], beta_lin=layer["activation_linear_beta"],
        latent_norm=layer["latent_norm"], eps=layer["eps"], mxfp4=layer["experts_mxfp4"],
        names=layer["tensor_names"])


# ---- the checkpoint's tensors -----------------------------------------------------------------------

def tensor_name(cfg, role, layer, expert=0):
    return cfg["names"][role].replace("{layer}", str(layer)).replace("{expert}", str(expert))


def gated(cfg):
    return cfg["act"] != "relu2"


def mxfp4_decode(packed, scales):
    """U8 [R, C/2] (low nibble the even column) and U8 E8M0 [R, C/32] → fp32 [R, C]."""
    table = torch.tensor(E2M1 + [-v for v in E2M1], dtype=torch.float32)
    low, high = (packed & 0x0F).long(), (packed >> 4).long()
    values = torch.stack([table[low], table[high]], dim=-1).reshape(packed.shape[0], -1)
    factors = torch.pow(2.0, scales.float() - 127.0).repeat_interleave(32, dim=1)
    return values * factors


def generate_checkpoint(cfg, folder, seed, layer=0):
    """The preset's layer `layer` with fan-in scaled normal weights from torch.Generator(seed)."""
    gen = torch.Generator().manual_seed(seed)
    d, l, e, inter, shared = cfg["d"], cfg["l"], cfg["experts"], cfg["inter"], cfg["shared"]

    def normal(*shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=gen) * std + mean

    def mxfp4(rows, cols):
        # e2m1 nibbles at random with one E8M0 scale per 32 columns: 6·2^(s−127) ≈ 2 / √cols.
        exponent = 127 + math.floor(math.log2(2.0 / math.sqrt(cols) / 6.0))
        nibbles = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
        packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
        scales = torch.full((rows, cols // 32), exponent, dtype=torch.uint8)
        return packed, scales

    tensors = {tensor_name(cfg, "router_weight", layer): normal(e, d, std=d ** -0.5),
               tensor_name(cfg, "latent_down", layer): normal(l, d, std=d ** -0.5).bfloat16(),
               tensor_name(cfg, "latent_up", layer): normal(d, l, std=l ** -0.5).bfloat16()}
    if cfg["bias"]:
        tensors[tensor_name(cfg, "router_bias", layer)] = normal(e, std=0.05)
    if cfg["latent_norm"]:
        tensors[tensor_name(cfg, "latent_norm", layer)] = normal(l, std=0.1, mean=1.0).bfloat16()
    roles = [("expert_gate", inter, l)] if gated(cfg) else []
    roles += [("expert_up", inter, l), ("expert_down", l, inter)]
    shards, shard = [], {}
    for expert in range(e):
        for role, rows, cols in roles:
            name = tensor_name(cfg, role, layer, expert)
            if cfg["mxfp4"]:
                shard[name + "_packed"], shard[name + "_scale"] = mxfp4(rows, cols)
            else:
                shard[name] = normal(rows, cols, std=cols ** -0.5).bfloat16()
        if sum(t.numel() * t.element_size() for t in shard.values()) > (2 << 30):
            shards.append(shard)
            shard = {}
    if shared:
        for role, rows, cols in ([("shared_gate", shared, d)] if gated(cfg) else []) + [
                ("shared_up", shared, d), ("shared_down", d, shared)]:
            shard[tensor_name(cfg, role, layer)] = normal(rows, cols, std=cols ** -0.5).bfloat16()
    shards.append(shard)
    shards.append(tensors)
    os.makedirs(folder, exist_ok=True)
    for i, part in enumerate(shards):
        write_safetensors(os.path.join(folder, f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"), part,
                          {"generator": f"benchmarks/torch_moe.py --seed {seed}"})


class TorchMoE:
    """The layer's weights on `device` (experts stacked: gate and up [E, I, l], down [E, l, I]) and
    its forward."""

    def __init__(self, cfg, ckpt, layer, device):
        self.cfg, self.device = cfg, device
        self.dtype = torch.bfloat16
        get = lambda role, expert=0: ckpt.get(tensor_name(cfg, role, layer, expert))

        def dense(role):
            return get(role).to(device=device, dtype=self.dtype)

        self.router_weight = get("router_weight").float().to(device)
        self.router_bias = get("router_bias").float().to(device) if cfg["bias"] else None
        self.latent_down = dense("latent_down")
        self.latent_up = dense("latent_up")
        self.gamma = dense("latent_norm") if cfg["latent_norm"] else None

        def experts(role):
            mats = []
            for e in range(cfg["experts"]):
                name = tensor_name(cfg, role, layer, e)
                if cfg["mxfp4"]:
                    value = mxfp4_decode(ckpt.get(name + "_packed"), ckpt.get(name + "_scale"))
                else:
                    value = ckpt.get(name)
                mats.append(value.to(device=device, dtype=self.dtype))
            return torch.stack(mats)

        self.expert_gate = experts("expert_gate") if gated(cfg) else None
        self.expert_up = experts("expert_up")
        self.expert_down = experts("expert_down")
        self.shared_gate = dense("shared_gate") if cfg["shared"] and gated(cfg) else None
        self.shared_up = dense("shared_up") if cfg["shared"] else None
        self.shared_down = dense("shared_down") if cfg["shared"] else None
        self.experts_impl = "loop"

    def activate(self, gate, up):
        """fp32 in, the storage dtype out (rounded once)."""
        cfg = self.cfg
        if cfg["act"] == "silu_glu":
            out = F.silu(gate) * up
        elif cfg["act"] == "situ_glu":
            beta, beta_lin = cfg["beta"], cfg["beta_lin"]
            out = beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (beta_lin * torch.tanh(up / beta_lin))
        else:
            out = torch.relu(up).square()
        return out.to(self.dtype)

    def route(self, x):
        """ids [T, k] and weights [T, k] (fp32), as src/core/router.cpp selects them."""
        cfg = self.cfg
        logits = torch.mm(x.float(), self.router_weight.t())
        scores = torch.sigmoid(logits) if cfg["score"] == "sigmoid" else torch.softmax(logits, dim=-1)
        biased = scores + self.router_bias if self.router_bias is not None else scores
        if cfg["n_group"] > 1:
            tokens, groups = biased.shape[0], cfg["n_group"]
            grouped = biased.view(tokens, groups, -1)
            if self.router_bias is not None and grouped.shape[-1] > 1:
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            else:
                group_scores = grouped.max(dim=-1).values
            best = group_scores.topk(cfg["topk_group"], dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            biased = biased.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        ids = biased.topk(cfg["top_k"], dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg["renormalize"]:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights * cfg["scale"]

    def experts_loop(self, z, ids, weights):
        """Per slot, the chosen experts' matrices gathered and multiplied by torch.bmm."""
        acc = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32, device=z.device)
        rows = z.unsqueeze(-1)  # [T, l, 1]
        for j in range(ids.shape[1]):
            e = ids[:, j]
            up = torch.bmm(self.expert_up[e], rows).squeeze(-1).float()
            gate = torch.bmm(self.expert_gate[e], rows).squeeze(-1).float() if self.expert_gate is not None else up
            hidden = self.activate(gate, up).unsqueeze(-1)
            out = torch.bmm(self.expert_down[e], hidden).squeeze(-1)
            acc += weights[:, j : j + 1] * out.float()
        return acc.to(self.dtype)

    def experts_grouped(self, z, ids, weights):
        """Slots sorted by expert, one torch._grouped_mm per matrix (offsets stay on the device)."""
        tokens, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # scatter_add, not bincount: bincount reads the largest id on the host, which a capture forbids.
        counts = torch.zeros(self.cfg["experts"], dtype=torch.int64, device=z.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        rows = z[order // k]
        up = torch._grouped_mm(rows, self.expert_up.transpose(-2, -1), offs=offsets).float()
        gate = (torch._grouped_mm(rows, self.expert_gate.transpose(-2, -1), offs=offsets).float()
                if self.expert_gate is not None else up)
        hidden = self.activate(gate, up)
        out = torch._grouped_mm(hidden, self.expert_down.transpose(-2, -1), offs=offsets)
        slots = torch.empty_like(out)
        slots[order] = out
        products = slots.view(tokens, k, -1).float() * weights.unsqueeze(-1)
        return products.sum(dim=1).to(self.dtype)

    def forward(self, x, impl=None):
        cfg = self.cfg
        ids, weights = self.route(x)
        z = torch.mm(x, self.latent_down.t())
        experts = self.experts_grouped if (impl or self.experts_impl) == "grouped" else self.experts_loop
        routed = experts(z, ids, weights)
        if self.shared_up is not None:
            up = torch.mm(x, self.shared_up.t()).float()
            gate = torch.mm(x, self.shared_gate.t()).float() if self.shared_gate is not None else up
            shared = torch.mm(self.activate(gate, up), self.shared_down.t())
        else:
            shared = torch.zeros(x.shape[0], cfg["d"], dtype=self.dtype, device=x.device)
        normed = F.rms_norm(routed, (cfg["l"],), self.gamma, cfg["eps"]) if self.gamma is not None else routed
        return torch.mm(normed, self.latent_up.t()) + shared, ids


# ---- against lmoe -----------------------------------------------------------------------------------

def compare(model, dump_dir):
    """Per dumped T: tokens routed alike, normwise and worst row error of y against lmoe's; ok."""
    results = []
    for path in sorted(glob.glob(os.path.join(dump_dir, "t*.safetensors")),
                       key=lambda p: int(os.path.basename(p)[1:].split(".")[0])):
        dump = Checkpoint(dump_dir, [path])
        x = dump.get("x").to(model.device)
        theirs_y = dump.get("y").float()
        theirs_ids = dump.get("expert_ids").long()
        # The loop gathers T·k experts' weights: past LOOP_MAX_TOKENS (8192 tokens: 168 GiB) the
        # grouped path, where this torch has it.
        impl = None
        if x.shape[0] > LOOP_MAX_TOKENS and x.is_cuda and hasattr(torch, "_grouped_mm"):
            impl = "grouped"
        with torch.no_grad():
            y, ids = model.forward(x, impl)
        y = y.float().cpu()
        same = (ids.cpu().sort(dim=1).values == theirs_ids.sort(dim=1).values).all(dim=1)
        mine, ref = y[same].double(), theirs_y[same].double()
        normwise = ((mine - ref).norm() / ref.norm()).item() if same.any() else 0.0
        rms = ref.square().mean(dim=1).sqrt()
        row = ((mine - ref).abs().max(dim=1).values / rms).max().item() if same.any() else 0.0
        ok = bool(same.any()) and normwise <= NORMWISE_TOLERANCE and row <= ROW_TOLERANCE
        results.append({"tokens": x.shape[0], "routed_alike": int(same.sum()), "normwise_error": normwise,
                        "max_row_error": row, "ok": ok})
        print(f"check T={x.shape[0]}: {int(same.sum())}/{x.shape[0]} tokens routed alike, normwise "
              f"{normwise:.3g} (tolerance {NORMWISE_TOLERANCE}), worst row {row:.3g} (tolerance "
              f"{ROW_TOLERANCE}): {'ok' if ok else 'FAIL'}", flush=True)
    if not results:
        raise SystemExit(f"--check-lmoe {dump_dir}: no t*.safetensors files (lmoe layer --dump-dir writes them)")
    return results


def run_lmoe(args, cfg, dump_dir, cold):
    """`lmoe layer --graph` at one rank on the checkpoint: {T: row} from its --json."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "layer.json")
        command = [args.lmoe, "layer", "--backend", "cuda", "--preset", args.preset, "--weights", args.weights,
                   "--layer", str(args.layer), "-n", "1", "--graph", "-t", ",".join(map(str, args.token_list)), "--repeats",
                   str(args.iters), "--no-check", "--json", path]
        command += ["--experts", str(args.experts)] if args.experts > 0 else []
        # MXFP4 experts stay packed in lmoe, as it serves such a checkpoint (this script dequantizes).
        command += ["--keep-packed"] if cfg["mxfp4"] else []
        command += ["--cold-l2"] if cold else ["--dump-dir", dump_dir]
        print("+", " ".join(command), flush=True)
        completed = subprocess.run(command, stdout=subprocess.PIPE, text=True)
        print(completed.stdout[-4000:], flush=True)
        if not os.path.exists(path):
            return {}, completed.returncode
        with open(path) as f:
            doc = json.load(f)
    return {row["tokens"]: row for row in doc["rows"]}, completed.returncode


def floors(model, tokens, ids, gemm_tflops, copy_gbs):
    """(bytes floor µs, FLOP floor µs): the active weights at the copy rate, the FLOPs at the GEMM rate."""
    cfg = model.cfg
    d, l, inter, shared, k = cfg["d"], cfg["l"], cfg["inter"], cfg["shared"], cfg["top_k"]
    mats = 3 if gated(cfg) else 2
    active = len(torch.unique(ids))
    weight_bytes = (cfg["experts"] * d * 4 + 2 * d * l * 2 + active * mats * inter * l * 2 + mats * shared * d * 2
                    + (l * 2 if cfg["latent_norm"] else 0))
    flops = 2 * tokens * (cfg["experts"] * d + 2 * d * l + k * mats * inter * l + mats * shared * d)
    return weight_bytes / copy_gbs / 1e3, flops / gemm_tflops / 1e6


def bench(args, model):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from graph_timing import l2_flush_buffer, measured_rates, time_graph

    torch.backends.cuda.matmul.allow_tf32 = False
    gemm_tflops, copy_gbs = measured_rates()
    print(f"rates: GEMM {gemm_tflops:.1f} TFLOP/s, device copy {copy_gbs:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(args.seed + 1)
    impls = ["grouped", "loop"] if args.experts_impl == "auto" else [args.experts_impl]
    if not hasattr(torch, "_grouped_mm"):
        impls = [i for i in impls if i != "grouped"]
        print(f"torch {torch.__version__} has no torch._grouped_mm: the loop over the chosen experts only")
    rows = {}
    for cold in (False, True):
        flush = l2_flush_buffer() if cold else None
        for tokens in args.token_list:
            x = torch.randn(tokens, model.cfg["d"], device="cuda", generator=gen).to(torch.bfloat16)
            out = {}
            for impl in impls:
                if impl == "loop" and tokens > LOOP_MAX_TOKENS:
                    continue
                try:
                    out[impl] = time_graph(lambda: model.forward(x, impl), 1, args.warmup, args.iters, flush)
                except RuntimeError as error:  # e.g. _grouped_mm on a GPU or shape it does not take
                    print(f"torch {impl} T={tokens}: {str(error).splitlines()[0]}", flush=True)
            with torch.no_grad():
                _, ids = model.forward(x, "loop" if "grouped" not in out else "grouped")
            bytes_us, flops_us = floors(model, tokens, ids, gemm_tflops, copy_gbs)
            rows[(tokens, cold)] = {"torch_us": out, "bytes_floor_us": bytes_us, "flops_floor_us": flops_us}
            print(f"torch T={tokens} {'cold' if cold else 'warm'}: {out}", flush=True)
            del x
        del flush
        torch.cuda.empty_cache()
    return rows, gemm_tflops, copy_gbs


def main():
    args = parse_args()
    cfg = describe_preset(lmoe_binary(args.lmoe), args.preset, args.experts)
    if args.generate:
        generate_checkpoint(cfg, args.generate, args.seed, args.layer)
        print(f"wrote {args.preset} layer {args.layer} (seed {args.seed}) to {args.generate}")
        if not args.weights:
            return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    model = TorchMoE(cfg, Checkpoint(args.weights), args.layer, torch.device(args.device))
    failed, checks = False, []
    lmoe_rows = {}
    with tempfile.TemporaryDirectory() as scratch:
        dump_dir = args.check_lmoe
        if args.lmoe:
            dump_dir = os.path.join(scratch, "dump")
            for cold in (False, True):
                lmoe_rows[cold], code = run_lmoe(args, cfg, dump_dir, cold)
                failed |= code != 0
        if dump_dir:
            checks = compare(model, dump_dir)
            failed |= not all(c["ok"] for c in checks)
    if args.device == "cpu" or not args.lmoe:
        return 1 if failed else 0

    rows, gemm_tflops, copy_gbs = bench(args, model)
    table = ["| L2 | T | lmoe µs | PyTorch µs (experts) | lmoe / PyTorch | bytes floor µs | FLOP floor µs |",
             "|---|---|---|---|---|---|---|"]
    records = []
    for cold in (False, True):
        for tokens in args.token_list:
            row = rows[(tokens, cold)]
            theirs = row["torch_us"]
            best = min(theirs, key=theirs.get) if theirs else None
            mine = lmoe_rows.get(cold, {}).get(tokens, {}).get("forward_us")
            ratio = mine / theirs[best] if mine and best else None
            records.append({"tokens": tokens, "l2": "cold" if cold else "warm", "lmoe_us": mine,
                            "torch_us": theirs, "torch_experts": best, "ratio": ratio, **{
                                k: row[k] for k in ("bytes_floor_us", "flops_floor_us")}})
            table.append(f"| {'cold' if cold else 'warm'} | {tokens} | {'-' if mine is None else f'{mine:.1f}'} | "
                         f"{'-' if best is None else f'{theirs[best]:.1f} ({best})'} | "
                         f"{'-' if ratio is None else f'{ratio:.2f}'} | {row['bytes_floor_us']:.1f} | "
                         f"{row['flops_floor_us']:.1f} |")
    text = "\n".join(table) + "\n"
    print(text, flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "preset": args.preset,
                       "weights": args.weights, "layer": args.layer, "iters": args.iters, "warmup": args.warmup,
                       "gemm_tflops": gemm_tflops, "copy_gbs": copy_gbs, "checks": checks, "rows": records,
                       "ok": not failed}, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
