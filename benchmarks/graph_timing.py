"""What the PyTorch-side benchmarks share: timing a body in a CUDA graph, evicting the L2 before a
timed replay, the GPU's measured GEMM and copy rates, and the -t list of token counts."""
import statistics

import torch


def parse_token_list(parser, text):
    """[T, ...] from "1,16,128", or a parser error naming the option."""
    fields = text.split(",")
    if not all(x.isdigit() and int(x) >= 1 for x in fields):
        parser.error(f"--tokens: expected comma-separated integers >= 1, got '{text}'")
    return [int(x) for x in fields]


def check_timing_args(parser, args):
    """--layers 1..64, --iters ≥ 1, --warmup ≥ 0 and a GPU, or a parser error."""
    if not 1 <= args.layers <= 64 or args.iters < 1 or args.warmup < 0:
        parser.error("--layers must be 1..64, --iters >= 1, --warmup >= 0")
    if not torch.cuda.is_available():
        parser.error("needs a GPU")


def l2_flush_buffer():
    """A buffer twice the GPU's L2: writing it evicts what the last replay left there."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return torch.empty(2 * l2 // 4 + 1, dtype=torch.float32, device="cuda")


def time_graph(body, layers, warmup, iters, flush=None):
    """Median µs per layer of a graph that runs body() once (body runs `layers` layers). With
    `flush`, the buffer is written before each timed replay, outside the timed span."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # eager first: cuBLAS handles and workspaces exist before capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for _ in range(warmup):
        graph.replay()
    # Replays back to back (as `lmoe bench` times them), each between its own pair of events; the
    # flush, when asked for, is enqueued between a replay's end event and the next one's start.
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush.fill_(1.0)
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    del graph
    return statistics.median(s.elapsed_time(e) * 1e3 / layers for s, e in zip(starts, ends))


def measured_rates():
    """(GEMM TFLOP/s of an 8192³ bf16 torch.mm, device-copy GB/s of 1 GiB), this run."""
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, n, device="cuda").to(torch.bfloat16)
    c = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    gemm_us = time_graph(lambda: torch.mm(a, b, out=c), 1, 3, 20)
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_us = time_graph(lambda: dst.copy_(src), 1, 3, 20)
    return 2 * n ** 3 / gemm_us / 1e6, 2 * src.numel() * 2 / copy_us / 1e3
