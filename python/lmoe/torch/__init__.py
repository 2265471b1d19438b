"""lmoe's tail as a torch module (LatentTail) and in the reference system's call shape
(latent_moe_tail). docs/python.md says how the ranks and the weights are handled."""
import atexit

import torch
import torch.distributed as dist

from .._ops import Error, call, ops

__all__ = ["Error", "LatentTail", "forget_tails", "latent_moe_tail"]

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}
_TIERS = ("auto", "fused", "overlap", "column", "token")


def _group_name(group):
    """The name under which c10d registered `group` (the world when None and torch.distributed is
    initialized); "" for one rank without torch.distributed."""
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if group is None:
        return ""
    return group.group_name


def _key(tensor):
    return (tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, tensor.device)


class LatentTail(torch.nn.Module):
    """Y = RMSNorm(Σ_r routed_r; norm_weight, eps) · up_weightᵀ + Σ_r shared_r, identical on every
    rank of `group`, by the tier lmoe's policy picks for T (or `tier`).

    The library copies the weights when the tail is built: by load_weights(), or by the first
    eager call with the weights it is given. Later calls must pass the same tensors (checked:
    same memory, shape and dtype); after changing the weights' values or tensors, call
    load_weights() again. Building is collective over the group, like the call itself.

    group: a torch.distributed process group (default: the world when torch.distributed is
    initialized, else one rank). Tensors on the CPU run lmoe's cpu backend over the group (gloo);
    CUDA tensors run the cuda backend over `comm` ("p2p" or "nccl"), set up through the group.
    latent_norm=False: no RMSNorm (Nemotron 3); norm_weight is then None.
    """

    def __init__(self, d_model, d_latent, dtype=torch.bfloat16, eps=1e-5, group=None,
                 max_tokens=8192, tier="auto", tier_table=None, latent_norm=True, comm="p2p"):
        super().__init__()
        if dtype not in _DTYPES:
            raise Error(f"dtype: expected torch.bfloat16, torch.float16 or torch.float32, got {dtype}")
        if tier not in _TIERS:
            raise Error(f"tier: expected one of {', '.join(_TIERS)}, got {tier}")
        self.d_model, self.d_latent, self.dtype = int(d_model), int(d_latent), dtype
        self.eps, self.max_tokens, self.tier = float(eps), int(max_tokens), tier
        self.tier_table = None if tier_table is None else str(tier_table)
        self.latent_norm, self.comm = bool(latent_norm), comm
        self.group_name = _group_name(group)
        self._handle = None
        self._ones = None   # the norm weight the library is given when latent_norm is False

    def load_weights(self, norm_weight, up_weight):
        """Builds the library's tail from these weights (copied), collectively over the group."""
        if not self.latent_norm and norm_weight is None:
            if self._ones is None or self._ones.device != up_weight.device:
                self._ones = torch.ones(self.d_latent, dtype=self.dtype, device=up_weight.device)
            norm_weight = self._ones
        handle = call(ops.tail_create, self.group_name, self.d_model, self.d_latent,
                      _DTYPES[self.dtype], self.eps, self.latent_norm, self.max_tokens,
                      self.tier_table, norm_weight, up_weight, self.comm)
        self._release()
        self._handle = handle
        return self

    def _norm_for(self, norm_weight):
        return self._ones if (not self.latent_norm and norm_weight is None) else norm_weight

    def forward(self, routed, shared, norm_weight, up_weight):
        """routed [T, l] and shared [T, d]: this rank's partials (the column tier overwrites
        shared); returns Y [T, d], a new tensor."""
        if not torch.compiler.is_compiling():
            if self._handle is None:
                self.load_weights(norm_weight, up_weight)
            out = torch.empty(shared.shape, dtype=shared.dtype, device=shared.device)
            call(ops.tail_forward, self._handle, routed, shared, self._norm_for(norm_weight),
                 up_weight, out, self.tier)
            return out
        # Traced by torch.compile: the tail must have been built (load_weights or an eager call).
        self._require_built()
        out = torch.empty(shared.shape, dtype=shared.dtype, device=shared.device)
        ops.tail_forward(self._handle, routed, shared, self._norm_for(norm_weight), up_weight, out,
                         self.tier)
        return out

    def _require_built(self):
        if self._handle is None:
            raise Error("this tail has no weights yet: call load_weights(norm_weight, up_weight) "
                        "or run it once")

    def explain(self, num_tokens):
        """Which tier runs T tokens here, which rule and setting chose it, and why other tiers
        cannot run (the library's explain)."""
        self._require_built()
        return call(ops.tail_explain, self._handle, int(num_tokens))

    def decide(self, num_tokens):
        """The tier the policy picks for T ("" when none can run)."""
        self._require_built()
        return call(ops.tail_decide, self._handle, int(num_tokens))

    @property
    def tp_rank(self):
        self._require_built()
        return ops.tail_info(self._handle)[0]

    @property
    def tp_size(self):
        self._require_built()
        return ops.tail_info(self._handle)[1]

    def extra_repr(self):
        return (f"d_model={self.d_model}, d_latent={self.d_latent}, dtype={self.dtype}, "
                f"eps={self.eps}, max_tokens={self.max_tokens}, tier={self.tier}")

    def _release(self):
        if self._handle is not None:
            ops.tail_destroy(self._handle)
            self._handle = None

    def __del__(self):
        try:
            self._release()
        except Exception:  # interpreter shutdown: the ops may be gone already
            pass


# (weights, eps, group, max_tokens, tier) -> (LatentTail, norm_weight, up_proj_weight). Holding the
# weights keeps their memory from being reused by other tensors under the same key.
_TAILS = {}


def forget_tails():
    """Drops the tails latent_moe_tail built; the next call builds anew (after weights changed in
    place, which the tails' copies do not see)."""
    _TAILS.clear()


# At exit the tails go first, while the interpreter and torch are whole: a tail keeps its process
# group alive, and a gloo group destroyed later, in the interpreter's teardown, can abort the process
# ("terminate called without an active exception") after the program has finished.
atexit.register(forget_tails)


def latent_moe_tail(fused_output, shared_output, norm_weight, up_proj_weight, eps, *, group=None,
                    max_tokens=8192, tier="auto"):
    """The reference system's tail in its call shape: fused_output [T, l] (this rank's routed latent
    partial), shared_output [T, d] (this rank's shared experts' partial, which the column tier
    overwrites), the latent norm's weight [l] (None: no norm), the up-projection's weight [d, l]
    and eps; returns Y [T, d], identical on every rank of `group`.

    One LatentTail per (weights, eps, group, max_tokens, tier) is kept and reused; the first call
    with new weights builds it (collectively), so warm up eagerly before capturing or compiling.
    Weights changed in place need forget_tails().
    """
    key = (None if norm_weight is None else _key(norm_weight), _key(up_proj_weight), float(eps),
           _group_name(group), int(max_tokens), tier)
    entry = _TAILS.get(key)
    if entry is None:
        d_model, d_latent = up_proj_weight.shape
        tail = LatentTail(d_model, d_latent, dtype=up_proj_weight.dtype, eps=eps, group=group,
                          max_tokens=max_tokens, tier=tier, latent_norm=norm_weight is not None)
        tail.load_weights(norm_weight, up_proj_weight)
        entry = _TAILS[key] = (tail, norm_weight, up_proj_weight)
    tail = entry[0]
    return tail(fused_output, shared_output, norm_weight, up_proj_weight)
