"""The library's reference (lmoe/reference.hpp) from every rank's inputs, for tests that compare
the ops with it bit for bit."""
import torch

from ._ops import call, ops


def reference_tail(routed_all, shared_all, norm_weight, up_proj_weight, eps=1e-5, tier="overlap",
                   latent_norm=True):
    """Y of the numerics contract that `tier` follows: routed_all [tp, T, l], shared_all [tp, T, d]
    (CPU tensors of one dtype) -> [T, d]."""
    contract = "column" if tier == "column" else "reduce_then_add"
    out = torch.empty(routed_all.shape[1], shared_all.shape[2], dtype=routed_all.dtype)
    if norm_weight is None:
        norm_weight = torch.ones(routed_all.shape[2], dtype=routed_all.dtype)
    call(ops.reference_tail, routed_all, shared_all, norm_weight, up_proj_weight, float(eps),
         latent_norm, contract, out)
    return out
