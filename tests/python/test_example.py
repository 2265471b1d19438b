"""python/examples/latent_moe_runner.py runs as one rank and as two gloo ranks (env:// rendezvous,
as torchrun sets it up) and matches plain torch.distributed."""
import os
import subprocess
import sys

import pytest

from conftest import free_port

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "python", "examples",
                       "latent_moe_runner.py")


@pytest.mark.parametrize("tp", [1, 2])
def test_example_runs(tp):
    port = free_port()
    ranks = []
    for rank in range(tp):
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if tp > 1:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(tp), LOCAL_RANK=str(rank))
        ranks.append(subprocess.Popen([sys.executable, EXAMPLE], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [process.communicate(timeout=300)[0] for process in ranks]
    assert all(process.returncode == 0 for process in ranks), outputs
    assert outputs[0].rstrip().endswith("ok") and "tier=column" in outputs[0], outputs[0]
