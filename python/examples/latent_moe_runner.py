#!/usr/bin/env python3
"""lmoe behind a vLLM-style LatentMoERunner: the routed experts leave this rank's partial of the
latent [T, l] and the shared experts this rank's partial of the output [T, d]; the tail (reduce,
RMSNorm, up-projection, add, reduce) is one call, lmoe.torch.latent_moe_tail, in the reference
system's argument order. Runs on the CPU with gloo ranks:

    torchrun --nproc_per_node=2 python/examples/latent_moe_runner.py
    python3 python/examples/latent_moe_runner.py            # one rank
"""
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lmoe.torch


class LatentMoERunner(torch.nn.Module):
    """A latent MoE layer split over tp ranks: experts and shared experts by their intermediate
    dimension (each rank's output is a partial sum), the latent norm and up-projection replicated."""

    def __init__(self, d_model, d_latent, num_experts, top_k, intermediate, tp_rank, tp_size,
                 dtype=torch.float32, eps=1e-5, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)  # the same weights on every rank

        def param(*shape, scale):
            return torch.nn.Parameter((torch.randn(*shape, generator=g) * scale).to(dtype),
                                      requires_grad=False)

        part = intermediate // tp_size
        rows = slice(tp_rank * part, (tp_rank + 1) * part)
        self.top_k, self.eps = top_k, eps
        self.router = param(num_experts, d_model, scale=d_model**-0.5)
        self.latent_down = param(d_latent, d_model, scale=d_model**-0.5)
        self.expert_up = torch.nn.Parameter(
            param(num_experts, intermediate, d_latent, scale=d_latent**-0.5)[:, rows].contiguous(),
            requires_grad=False)
        self.expert_down = torch.nn.Parameter(
            param(num_experts, d_latent, intermediate, scale=intermediate**-0.5)[:, :, rows]
            .contiguous(), requires_grad=False)
        self.shared_up = torch.nn.Parameter(
            param(intermediate, d_model, scale=d_model**-0.5)[rows].contiguous(), requires_grad=False)
        self.shared_down = torch.nn.Parameter(
            param(d_model, intermediate, scale=intermediate**-0.5)[:, rows].contiguous(),
            requires_grad=False)
        self.latent_norm = param(d_latent, scale=0.0)
        self.latent_norm.data += 1
        self.latent_up = param(d_model, d_latent, scale=d_latent**-0.5)

    def partials(self, hidden):
        """This rank's routed latent partial [T, l] and shared experts' partial [T, d]."""
        weights, experts = torch.topk(torch.sigmoid(hidden @ self.router.t()), self.top_k, dim=-1)
        latent = hidden @ self.latent_down.t()
        fused_output = torch.zeros_like(latent)  # [T, l]: this rank's partial
        for k in range(self.top_k):
            up = torch.einsum("tl,til->ti", latent, self.expert_up[experts[:, k]])
            down = torch.einsum("ti,tli->tl", F.relu(up).square(), self.expert_down[experts[:, k]])
            fused_output += weights[:, k, None] * down
        shared_output = F.silu(hidden @ self.shared_up.t()) @ self.shared_down.t()  # [T, d] partial
        return fused_output, shared_output

    def forward(self, hidden):  # [T, d], replicated
        fused_output, shared_output = self.partials(hidden)
        # The tail: what LatentMoERunner does by tier (fused, overlap, column), here lmoe's choice.
        return lmoe.torch.latent_moe_tail(fused_output, shared_output, self.latent_norm,
                                          self.latent_up, self.eps)


def torch_tail(fused_output, shared_output, norm_weight, up_weight, eps):
    """The reference system's overlap tail in plain torch.distributed, to compare with."""
    latent, shared = fused_output.clone(), shared_output.clone()
    if dist.is_initialized():
        dist.all_reduce(latent)
        dist.all_reduce(shared)
    normed = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + eps) * norm_weight
    return normed @ up_weight.t() + shared


def main():
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    tp = dist.get_world_size() if dist.is_initialized() else 1
    layer = LatentMoERunner(d_model=256, d_latent=128, num_experts=16, top_k=4, intermediate=64,
                            tp_rank=rank, tp_size=tp)
    for tokens in (1, 7, 64, 300):
        hidden = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens))
        y = layer(hidden)
        expected = torch_tail(*layer.partials(hidden), layer.latent_norm, layer.latent_up, layer.eps)
        error = (y - expected).abs().max().item()
        tier = next(iter(lmoe.torch._TAILS.values()))[0].decide(tokens)
        if rank == 0:
            print(f"T={tokens:4d} tier={tier:8s} max|lmoe - torch| = {error:.2e}")
        assert error < 1e-3, error
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 0:
        print("ok")


if __name__ == "__main__":
    main()
