"""The reference system's tails transcribed in PyTorch from every rank's inputs: all-reduces are
sums over the ranks in fp32 rounded once (what an exact all-reduce gives), the rest is the
reference's torch code (scripts/torch_baseline.py): overlap and, with the same math, fused and
token; column accumulates each rank's stripe into its shared partial before the final sum."""
import torch


def all_reduce(parts):
    return torch.stack([p.float() for p in parts]).sum(0).to(parts[0].dtype)


def rmsnorm(x, gamma, eps):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * gamma.float()).to(x.dtype)


def mm(a, b):
    return torch.mm(a.float(), b.float()).to(a.dtype)


def reference_tier(tier, routed, shared, gamma, w_up, eps):
    """routed [tp, T, l], shared [tp, T, d] -> Y [T, d] as the reference system's `tier` computes it."""
    tp = routed.shape[0]
    latent = all_reduce(list(routed))
    normed = latent if gamma is None else rmsnorm(latent, gamma, eps)
    if tier != "column":
        return (mm(normed, w_up.t()).float() + all_reduce(list(shared)).float()).to(shared.dtype)
    s = w_up.shape[0] // tp
    parts = []
    for r in range(tp):
        part = shared[r].clone()
        stripe = part[:, r * s:(r + 1) * s]
        stripe.copy_((stripe.float() + mm(normed, w_up[r * s:(r + 1) * s].t()).float()).to(part.dtype))
        parts.append(part)
    return all_reduce(parts)


def make_inputs(tp, tokens, d_model, d_latent, dtype, seed=2026):
    """Every rank's inputs, the same on every rank (one generator): routed [tp, T, l],
    shared [tp, T, d], gamma [l], w_up [d, l]."""
    g = torch.Generator().manual_seed(seed * 1000 + tokens * 10 + tp)
    gamma = (1.0 + 0.1 * torch.randn(d_latent, generator=g)).to(dtype)
    w_up = (torch.randn(d_model, d_latent, generator=g) / d_latent**0.5).to(dtype)
    routed = torch.randn(tp, tokens, d_latent, generator=g).to(dtype)
    shared = torch.randn(tp, tokens, d_model, generator=g).to(dtype)
    return routed, shared, gamma, w_up
