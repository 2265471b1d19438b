"""Runs a function on tp gloo ranks (torch.multiprocessing spawn) and collects what each returns."""
import os
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port


def _rank_main(rank, tp, port, fn, args, out_dir):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=tp)
    try:
        result = fn(rank, tp, *args)
    except BaseException:  # the parent reports it with the rank
        result = {"__error__": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def run_ranks(tp, fn, *args, tmp_dir):
    """fn(rank, tp, *args) on tp processes of one gloo group; returns each rank's result."""
    mp.spawn(_rank_main, args=(tp, free_port(), fn, args, str(tmp_dir)), nprocs=tp, join=True)
    results = [torch.load(os.path.join(tmp_dir, f"rank{r}.pt"), weights_only=False) for r in range(tp)]
    for rank, result in enumerate(results):
        if isinstance(result, dict) and "__error__" in result:
            raise AssertionError(f"rank {rank} failed:\n{result['__error__']}")
    return results
