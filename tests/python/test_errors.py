"""Bad input raises lmoe.Error with the library's message, on every rank, before anything runs."""
import pytest
import torch

import lmoe
import lmoe.torch
from ranks import run_ranks

D, L = 64, 32


def _weights(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(7)
    return ((1 + 0.1 * torch.randn(L, generator=g)).to(dtype),
            (torch.randn(D, L, generator=g) / L**0.5).to(dtype))


def _tail(**options):
    gamma, w_up = _weights()
    return lmoe.torch.LatentTail(D, L, dtype=torch.bfloat16, max_tokens=64, **options) \
        .load_weights(gamma, w_up), gamma, w_up


def _inputs(tokens=5, dtype=torch.bfloat16):
    return torch.randn(tokens, L).to(dtype), torch.randn(tokens, D).to(dtype)


def _message(call):
    with pytest.raises(lmoe.Error) as caught:
        call()
    return str(caught.value)


def test_error_is_a_runtime_error():
    assert issubclass(lmoe.Error, RuntimeError)


@pytest.mark.parametrize("case, expected", [
    ("dtype", "routed: expected dtype bf16, got f32"),
    ("int dtype", "shared: expected dtype bf16, got int32"),
    ("shape", "routed: expected shape [5, 32], got [5, 31]"),
    ("rows", "shared: expected shape [5, 64], got [6, 64]"),
    ("3-D", "routed: expected a 2-D tensor, got 3-D [1, 5, 32]"),
    ("strides", "shared: expected unit stride along the last dimension, got strides [1, 5]"),
    ("row stride", "routed: expected a contiguous tensor (row stride 32), got row stride 64"),
    ("max_tokens", "routed: expected at most max_tokens=64 rows (set at construction), got 65 rows"),
    ("other weights", "up_proj_weight: expected the tensor this tail was built with"),
    ("tier", "tier: unknown tier 'fastest': expected auto, fused, overlap, column or token"),
])
def test_bad_input_is_refused_with_its_message(case, expected):
    tail, gamma, w_up = _tail()
    routed, shared = _inputs()
    if case == "dtype":
        routed = routed.float()
    elif case == "int dtype":
        shared = shared.to(torch.int32)
    elif case == "shape":
        routed = routed[:, :31]
    elif case == "rows":
        shared = torch.randn(6, D).bfloat16()
    elif case == "3-D":
        routed = routed[None]
    elif case == "strides":
        shared = torch.randn(D, 5).bfloat16().t()
    elif case == "row stride":
        routed = torch.randn(5, 2 * L).bfloat16()[:, :L]
    elif case == "max_tokens":
        routed, shared = _inputs(65)
    elif case == "other weights":
        w_up = w_up.clone()
    elif case == "tier":
        tail.tier = "fastest"
    before = shared.clone() if shared.dtype == torch.bfloat16 and shared.device.type == "cpu" else None
    message = _message(lambda: tail(routed, shared, gamma, w_up))
    assert expected in message, message
    if before is not None and before.shape == shared.shape:
        assert torch.equal(before, shared), "shared was touched by a refused call"


def test_a_tier_that_cannot_run_is_refused_not_replaced():
    tail, gamma, w_up = _tail(tier="fused")
    routed, shared = _inputs(0)
    assert tail(routed, shared, gamma, w_up).shape == (0, D)  # T = 0 runs nothing


def test_bad_construction():
    gamma, w_up = _weights()
    with pytest.raises(lmoe.Error, match="dtype: expected torch.bfloat16"):
        lmoe.torch.LatentTail(D, L, dtype=torch.int8)
    with pytest.raises(lmoe.Error, match=r"up_proj_weight: expected shape \[64, 32\], got \[32, 64\]"):
        lmoe.torch.LatentTail(D, L).load_weights(gamma, w_up.t().contiguous())
    with pytest.raises(lmoe.Error, match="norm_weight: expected dtype bf16, got f32"):
        lmoe.torch.LatentTail(D, L).load_weights(gamma.float(), w_up)
    with pytest.raises(lmoe.Error, match="this tail has no weights yet"):
        lmoe.torch.LatentTail(D, L).explain(4)


def _bad_on_one_rank(rank, tp, case):
    gamma, w_up = _weights()
    tail = lmoe.torch.LatentTail(D, L, dtype=torch.bfloat16, max_tokens=64)
    tail.load_weights(gamma, w_up)
    tokens = 5
    if case == "disagree on T" and rank == 1:
        tokens = 6
    routed, shared = _inputs(tokens)
    if case == "dtype on rank 1" and rank == 1:
        routed = routed.float()
    given = w_up.clone() if case == "weights on rank 1" and rank == 1 else w_up
    try:
        tail(routed, shared, gamma, given)
    except lmoe.Error as error:
        # The group still works after a refused call.
        routed, shared = _inputs(5)
        y = tail(routed, shared, gamma, w_up)
        return str(error), y.shape
    return None, None


@pytest.mark.parametrize("case, expected", [
    ("dtype on rank 1", "rank 1: routed: expected dtype bf16, got f32"),
    ("weights on rank 1", "rank 1: up_proj_weight: expected the tensor this tail was built with"),
    ("disagree on T", "ranks disagree on the call: rank 0 has T=5"),
])
def test_ranks_fail_alike(case, expected, tmp_path):
    results = run_ranks(2, _bad_on_one_rank, case, tmp_dir=tmp_path)
    messages = [message for message, _ in results]
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert expected in messages[0], messages[0]
    assert all(shape == (5, D) for _, shape in results)


def _configs_disagree(rank, tp):
    gamma, w_up = _weights()
    tail = lmoe.torch.LatentTail(D, L, dtype=torch.bfloat16, eps=1e-5 if rank == 0 else 1e-6)
    try:
        tail.load_weights(gamma, w_up)
    except lmoe.Error as error:
        return str(error)
    return None


def test_ranks_built_differently_fail_alike(tmp_path):
    messages = run_ranks(2, _configs_disagree, tmp_dir=tmp_path)
    assert messages[0] is not None and messages[0] == messages[1]
    assert messages[0].startswith("ranks disagree on the configuration"), messages[0]
