"""Every tier through the torch ops on 1–4 gloo ranks (the c10d communicator), T = 1 … 300:
every rank returns the same bits, those bits are the C++ library's own for the same tier and inputs
(lmoe.testing.library_tail: its cpu backend on threads) exactly, and they are within atol 8e-2,
rtol 3e-2 of the reference system's tiers transcribed in PyTorch. (The contract's reference is not
a bit-for-bit target for every tier: the token tier's GEMM covers a rank's own rows, and the host
GEMM's order depends on the shape of the call, docs/numerics.md; the C++ tests judge the library
against the reference with the contract's bound.)"""
import pytest
import torch

import lmoe
import lmoe.torch
from lmoe.testing import library_tail, reference_tail
from ranks import run_ranks
from reference_tiers import make_inputs, reference_tier

D_MODEL, D_LATENT, DTYPE, EPS = 384, 192, torch.bfloat16, 1e-5
TOKENS = (1, 5, 8, 16, 33, 65, 129, 300)
TIERS = ("auto", "fused", "overlap", "column", "token")


def _run_every_tier(rank, tp):
    results = {}
    for tier in TIERS:
        tail = lmoe.torch.LatentTail(D_MODEL, D_LATENT, dtype=DTYPE, eps=EPS, max_tokens=512,
                                     tier=tier)
        for tokens in TOKENS:
            routed, shared, gamma, w_up = make_inputs(tp, tokens, D_MODEL, D_LATENT, DTYPE)
            # The weights are fresh per T: the tail is rebuilt from them.
            tail.load_weights(gamma, w_up)
            mine = shared[rank].clone()
            try:
                y = tail(routed[rank], mine, gamma, w_up)
                results[(tier, tokens)] = (y, tail.decide(tokens))
            except lmoe.Error as error:
                results[(tier, tokens)] = ("error", str(error))
    return results


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_every_tier_against_references(tp, tmp_path):
    per_rank = run_ranks(tp, _run_every_tier, tmp_dir=tmp_path)
    checked = 0
    for tier in TIERS:
        for tokens in TOKENS:
            outcomes = [r[(tier, tokens)] for r in per_rank]
            if tier == "token" and tokens < tp:
                # The token tier needs T >= tp: refused alike on every rank.
                for kind, text in outcomes:
                    assert kind == "error"
                    assert text == outcomes[0][1]
                assert f"tier token cannot run T={tokens}: T={tokens} < tp={tp}" in outcomes[0][1]
                continue
            for rank, (y, chosen) in enumerate(outcomes):
                assert not isinstance(y, str), f"rank {rank} {tier} T={tokens}: {chosen}"
                assert torch.equal(y.view(torch.int16), outcomes[0][0].view(torch.int16)), \
                    f"rank {rank} differs from rank 0 ({tier}, T={tokens})"
            y = outcomes[0][0]
            ran = tier if tier != "auto" else outcomes[0][1]
            routed, shared, gamma, w_up = make_inputs(tp, tokens, D_MODEL, D_LATENT, DTYPE)
            library = library_tail(routed, shared, gamma, w_up, EPS, ran)
            assert torch.equal(y.view(torch.int16), library.view(torch.int16)), \
                f"{tier} T={tokens} tp={tp}: not the C++ library's output bit for bit"
            torch_ref = reference_tier(ran, routed, shared, gamma, w_up, EPS)
            torch.testing.assert_close(y.float(), torch_ref.float(), atol=8e-2, rtol=3e-2)
            checked += 1
    assert checked >= len(TIERS) * len(TOKENS) - (tp - 1)


def test_the_policy_picks_by_tokens(tmp_path):
    """With the defaults, fused up to 128 tokens, overlap up to 256, column above."""
    _, _, gamma, w_up = make_inputs(1, 1, D_MODEL, D_LATENT, DTYPE)
    tail = lmoe.torch.LatentTail(D_MODEL, D_LATENT, dtype=DTYPE).load_weights(gamma, w_up)
    assert [tail.decide(t) for t in (1, 128, 129, 256, 257)] == \
        ["fused", "fused", "overlap", "overlap", "column"]
    assert "decision: T=129 → overlap" in tail.explain(129)


@pytest.mark.parametrize("tier", ["fused", "overlap", "column", "token"])
def test_without_the_latent_norm(tier):
    """latent_norm=False (Nemotron 3): N is the reduced latent itself; norm_weight is None."""
    routed, shared, _, w_up = make_inputs(1, 33, D_MODEL, D_LATENT, DTYPE)
    tail = lmoe.torch.LatentTail(D_MODEL, D_LATENT, dtype=DTYPE, tier=tier, latent_norm=False)
    y = tail(routed[0], shared[0].clone(), None, w_up)
    contract = reference_tail(routed, shared, None, w_up, EPS, tier, latent_norm=False)
    assert torch.equal(y, contract)
    torch_ref = reference_tier(tier, routed, shared, None, w_up, EPS)
    torch.testing.assert_close(y.float(), torch_ref.float(), atol=8e-2, rtol=3e-2)


def test_the_engines_call_shape():
    """latent_moe_tail(fused_output, shared_output, norm_weight, up_proj_weight, eps): one tail per
    weights, reused; the policy's tier; the contract's bits."""
    lmoe.torch.forget_tails()
    for tokens in (1, 129, 300):
        routed, shared, gamma, w_up = make_inputs(1, 1, D_MODEL, D_LATENT, DTYPE)
        routed, shared, _, _ = make_inputs(1, tokens, D_MODEL, D_LATENT, DTYPE)
        y = lmoe.torch.latent_moe_tail(routed[0], shared[0].clone(), gamma, w_up, EPS)
        tier = ("fused", "overlap", "column")[(1, 129, 300).index(tokens)]
        assert torch.equal(y, reference_tail(routed, shared, gamma, w_up, EPS, tier))
        del gamma, w_up
    assert len(lmoe.torch._TAILS) == 3  # fresh weights each time: three tails
