"""lmoe: the latent Mixture-of-Experts layer's tail under tensor parallelism, as torch ops.

    import lmoe.torch
    tail = lmoe.torch.LatentTail(d_model, d_latent, dtype=torch.bfloat16)
    y = tail(routed, shared, norm_weight, up_weight)

The ops (torch.ops.lmoe.*) are registered when this package is imported. docs/python.md.
"""
from ._ops import Error, __version__, ops  # noqa: F401

__all__ = ["Error", "ops", "__version__"]
