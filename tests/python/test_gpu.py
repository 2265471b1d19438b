"""The ops on a GPU: one rank eager, ranks sharing one GPU (p2p between processes), CUDA-graph
capture and replay with changing T and inputs, and torch.compile. Each test skips without a GPU or
without a CUDA build of the ops (docs/python.md, "What runs where")."""
import os

import pytest
import torch

import lmoe
import lmoe.torch
from ranks import run_ranks
from reference_tiers import make_inputs, reference_tier

D, L, DTYPE, EPS = 512, 256, torch.bfloat16, 1e-5
TIERS = ("fused", "overlap", "column", "token")


def _cuda_build():
    if not torch.cuda.is_available():
        return False
    gamma, w_up = torch.ones(L, dtype=DTYPE), torch.zeros(D, L, dtype=DTYPE)
    try:
        lmoe.torch.LatentTail(D, L, dtype=DTYPE).load_weights(gamma.cuda(), w_up.cuda())
    except lmoe.Error as error:
        return "no CUDA support" not in str(error)
    return True


pytestmark = pytest.mark.skipif(not _cuda_build(), reason="needs a GPU and the ops built with CUDA")


def _on_gpu(tokens, tp=1, rank=0):
    routed, shared, gamma, w_up = make_inputs(tp, tokens, D, L, DTYPE)
    return routed, shared, gamma.cuda(), w_up.cuda()


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("tokens", [1, 5, 16, 33, 129, 300])
def test_one_rank_eager(tier, tokens):
    routed, shared, gamma, w_up = _on_gpu(tokens)
    tail = lmoe.torch.LatentTail(D, L, dtype=DTYPE, max_tokens=512, tier=tier)
    try:
        y = tail(routed[0].cuda(), shared[0].cuda(), gamma, w_up)
    except lmoe.Error as error:
        assert tier == "fused" and "fused" in str(error)  # declined with its reason
        return
    expected = reference_tier(tier, routed, shared, gamma.cpu(), w_up.cpu(), EPS)
    torch.testing.assert_close(y.cpu().float(), expected.float(), atol=8e-2, rtol=3e-2)


def test_a_cpu_tensor_is_refused_by_a_gpu_tail():
    routed, shared, gamma, w_up = _on_gpu(4)
    tail = lmoe.torch.LatentTail(D, L, dtype=DTYPE).load_weights(gamma, w_up)
    with pytest.raises(lmoe.Error, match=r"routed: expected a tensor on cuda:0 .*, got cpu"):
        tail(routed[0], shared[0].cuda(), gamma, w_up)


def test_graph_capture_and_replay_with_changing_tokens_and_inputs():
    _, _, gamma, w_up = _on_gpu(1)
    tail = lmoe.torch.LatentTail(D, L, dtype=DTYPE, max_tokens=512).load_weights(gamma, w_up)
    graphs = {}
    for tokens in (1, 8, 33, 300):  # one graph per T, as engines capture one per batch size
        routed, shared, _, _ = _on_gpu(tokens)
        static_routed, static_shared = routed[0].cuda(), shared[0].cuda()
        tail(static_routed, static_shared.clone(), gamma, w_up)  # eager first (docs/graphs.md)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_y = tail(static_routed, static_shared, gamma, w_up)
        graphs[tokens] = (graph, static_routed, static_shared, static_y)
    for seed in (1, 2):
        for tokens, (graph, static_routed, static_shared, static_y) in graphs.items():
            routed, shared, _, _ = make_inputs(1, tokens, D, L, DTYPE, seed=seed)
            static_routed.copy_(routed[0])
            static_shared.copy_(shared[0])
            graph.replay()
            torch.cuda.synchronize()
            eager = tail(routed[0].cuda(), shared[0].cuda(), gamma, w_up)
            assert torch.equal(static_y, eager)


def test_compiled_on_gpu():
    routed, shared, gamma, w_up = _on_gpu(33)
    tail = lmoe.torch.LatentTail(D, L, dtype=DTYPE, max_tokens=512).load_weights(gamma, w_up)
    compiled = torch.compile(lambda r, s: tail(r, s, gamma, w_up) * 2, fullgraph=True)
    for tokens in (33, 5):
        routed, shared, _, _ = _on_gpu(tokens)
        r, s = routed[0].cuda(), shared[0].cuda()
        assert torch.equal(compiled(r, s.clone()), tail(r, s.clone(), gamma, w_up) * 2)


def _shared_gpu_ranks(rank, tp):
    os.environ["LMOE_P2P_SHARED_GPU"] = "1"
    torch.cuda.set_device(0)
    results = {}
    for tier in TIERS:
        for tokens in (1, 16, 129):
            routed, shared, gamma, w_up = make_inputs(tp, tokens, D, L, DTYPE)
            tail = lmoe.torch.LatentTail(D, L, dtype=DTYPE, max_tokens=512, tier=tier,
                                         comm="p2p").load_weights(gamma.cuda(), w_up.cuda())
            try:
                y = tail(routed[rank].cuda(), shared[rank].cuda(), gamma.cuda(), w_up.cuda())
                results[(tier, tokens)] = y.cpu()
            except lmoe.Error as error:
                results[(tier, tokens)] = str(error)
    return results


@pytest.mark.skipif(os.environ.get("LMOE_P2P_SHARED_GPU") != "1",
                    reason="ranks sharing a GPU over p2p are opt-in (LMOE_P2P_SHARED_GPU=1)")
def test_ranks_sharing_one_gpu(tmp_path):
    tp = 2
    per_rank = run_ranks(tp, _shared_gpu_ranks, tmp_dir=tmp_path)
    for key, y in per_rank[0].items():
        if isinstance(y, str):
            assert per_rank[1][key] == y  # declined alike
            continue
        assert torch.equal(y, per_rank[1][key])
        routed, shared, gamma, w_up = make_inputs(tp, key[1], D, L, DTYPE)
        expected = reference_tier(key[0], routed, shared, gamma, w_up, EPS)
        torch.testing.assert_close(y.float(), expected.float(), atol=8e-2, rtol=3e-2)
