"""The library's reference (lmoe/reference.hpp) and the library's own result, from every rank's
inputs, for tests that compare the ops with them."""
import torch

from ._ops import call, ops


def _from_every_rank(op, routed_all, shared_all, norm_weight, up_proj_weight, eps, latent_norm,
                     what):
    out = torch.empty(routed_all.shape[1], shared_all.shape[2], dtype=routed_all.dtype)
    if norm_weight is None:
        norm_weight = torch.ones(routed_all.shape[2], dtype=routed_all.dtype)
    call(op, routed_all, shared_all, norm_weight, up_proj_weight, float(eps), latent_norm, what, out)
    return out


def reference_tail(routed_all, shared_all, norm_weight, up_proj_weight, eps=1e-5, tier="overlap",
                   latent_norm=True):
    """Y of the numerics contract that `tier` follows: routed_all [tp, T, l], shared_all [tp, T, d]
    (CPU tensors of one dtype) -> [T, d]."""
    contract = "column" if tier == "column" else "reduce_then_add"
    return _from_every_rank(ops.reference_tail, routed_all, shared_all, norm_weight,
                            up_proj_weight, eps, latent_norm, contract)


def library_tail(routed_all, shared_all, norm_weight, up_proj_weight, eps=1e-5, tier="overlap",
                 latent_norm=True):
    """Y as the C++ library computes `tier` from routed_all [tp, T, l] and shared_all [tp, T, d]
    (CPU tensors of one dtype): its cpu backend on tp threads. The ops over any exact communicator
    return these bits; the contract's reference (reference_tail) may differ from them within the
    GEMM-order bound, because the host GEMM's order depends on the shape of each call
    (docs/numerics.md)."""
    return _from_every_rank(ops.library_tail, routed_all, shared_all, norm_weight, up_proj_weight,
                            eps, latent_norm, tier)
