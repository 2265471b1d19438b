"""torch.compile(fullgraph=True) traces a model that calls the tail (the default backend,
inductor, on the CPU), and the ops' fake implementations give the shapes a trace needs."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import lmoe
import lmoe.torch
from lmoe.testing import reference_tail
from reference_tiers import make_inputs

D, L, DTYPE = 128, 64, torch.bfloat16


class Block(torch.nn.Module):
    """A model's forward around the tail: something before it, the tail, something after."""

    def __init__(self, gamma, w_up, tier="auto"):
        super().__init__()
        self.gamma = torch.nn.Parameter(gamma, requires_grad=False)
        self.w_up = torch.nn.Parameter(w_up, requires_grad=False)
        self.tail = lmoe.torch.LatentTail(D, L, dtype=DTYPE, max_tokens=256, tier=tier)
        self.tail.load_weights(self.gamma, self.w_up)

    def forward(self, routed, shared):
        y = self.tail(routed * 1, shared + 0, self.gamma, self.w_up)
        return y * 2


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
@pytest.mark.parametrize("tier", ["auto", "column"])
def test_compiled_fullgraph_matches_eager(backend, tier):
    routed, shared, gamma, w_up = make_inputs(1, 33, D, L, DTYPE)
    block = Block(gamma, w_up, tier)
    compiled = torch.compile(block, fullgraph=True, backend=backend)
    for tokens in (33, 5, 129):  # changing T
        routed, shared, _, _ = make_inputs(1, tokens, D, L, DTYPE)
        routed, shared = routed[0], shared[0]
        eager = block(routed, shared.clone())
        y = compiled(routed, shared.clone())
        assert torch.equal(y, eager)
        contract = reference_tail(routed[None], shared[None], gamma, w_up, 1e-5,
                                  tier if tier != "auto" else block.tail.decide(tokens))
        assert torch.equal(y, contract * 2)


def test_compiled_graph_keeps_the_mutation_of_shared():
    """The column tier writes into shared (Tensor(a!)): a compiled caller sees it as eager does."""
    _, _, gamma, w_up = make_inputs(1, 1, D, L, DTYPE)
    tail = lmoe.torch.LatentTail(D, L, dtype=DTYPE, tier="column").load_weights(gamma, w_up)

    def f(routed, shared):
        y = tail(routed, shared, gamma, w_up)
        return y, shared

    routed, shared, _, _ = make_inputs(1, 8, D, L, DTYPE)
    eager_shared, compiled_shared = shared[0].clone(), shared[0].clone()
    y_eager, _ = f(routed[0], eager_shared)
    y_compiled, _ = torch.compile(f, fullgraph=True, backend="aot_eager")(routed[0], compiled_shared)
    assert torch.equal(y_eager, y_compiled)
    assert torch.equal(eager_shared, compiled_shared)
    assert not torch.equal(compiled_shared, shared[0])  # it was written


@pytest.mark.parametrize("tokens", [0, 1, 7, 300])
def test_fake_shapes(tokens):
    _, _, gamma, w_up = make_inputs(1, 1, D, L, DTYPE)
    tail = lmoe.torch.LatentTail(D, L, dtype=DTYPE, max_tokens=512).load_weights(gamma, w_up)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        routed = torch.empty(tokens, L, dtype=DTYPE)
        shared = torch.empty(tokens, D, dtype=DTYPE)
        y = tail(routed, shared, gamma, w_up)
        assert mode is not None and type(y).__name__ == "FakeTensor"
        assert y.shape == (tokens, D) and y.dtype == DTYPE
    # The meta implementation is the same one.
    out = torch.empty(tokens, D, dtype=DTYPE, device="meta")
    assert lmoe.ops.tail_forward(tail._handle, routed.to("meta"), shared.to("meta"), gamma, w_up,
                                 out) is None


def test_schema_declares_the_mutations():
    schema = str(torch.ops.lmoe.tail_forward.default._schema)
    assert "Tensor(a!) shared" in schema and "Tensor(b!) out" in schema
    assert schema.endswith("-> ()")
