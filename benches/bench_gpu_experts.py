"""GPU expert kernels on the MoE shape of Qwen3-30B-A3B (hidden 2048, expert FFN 768, 128
experts, top-8, Q4_0 by default), through libfreetoken_cuda:

- the cost of one ``expert_matmul`` call from Python (what a per-matrix launch costs),
- ``moe_layer`` (gate+up, activation, down, weighted sum in one call) eagerly from Python, per
  layer, at 1 to 512 tokens,
- the decode step's MoE part as one CUDA graph over all layers, replayed: per layer, per
  token, and the HBM bandwidth it reaches (expert bytes read over time).

    python benches/bench_gpu_experts.py [--layers 48] [--type Q4_0] [--json FILE]

Expert bytes are tiled from a few quantized matrices (fast to make; every slot still has its
own memory). Run by ``scripts/device.sh bench``; figures in benches/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from freetoken import quant
from freetoken.runtime import gpu

HIDDEN, FFN, EXPERTS, TOP_K = 2048, 768, 128, 8


def make_pool(qtype: str, k: int, n: int, seed: int) -> gpu.ExpertPool:
    """A pool of EXPERTS matrices (n, k): 4 distinct quantized matrices, tiled."""
    rng = np.random.default_rng(seed)
    pool = gpu.ExpertPool(qtype, k, n, EXPERTS)
    distinct = [
        torch.frombuffer(
            bytearray(quant.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)),
            dtype=torch.uint8,
        ).cuda()
        for _ in range(4)
    ]
    body = pool.tensor[: pool.matrix_nbytes * EXPERTS].view(EXPERTS, pool.matrix_nbytes)
    for s in range(EXPERTS):
        body[s].copy_(distinct[s % 4])
    return pool


def route(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(t, EXPERTS, device="cuda", generator=g)
    w, ids = torch.topk(torch.softmax(logits, dim=-1), TOP_K, dim=-1)
    return ids.to(torch.int32), (w / w.sum(-1, keepdim=True)).float()


def wall_per_call(fn, n: int) -> float:
    """Median over 5 rounds of (wall time of n back-to-back calls, synchronized) / n, in us."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(rounds)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s): the HBM ceiling."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        b.copy_(a)
    e1.record()
    torch.cuda.synchronize()
    return 2 * a.numel() * 10 / (e0.elapsed_time(e1) / 1e3) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--type", default="Q4_0")
    ap.add_argument("--json")
    args = ap.parse_args()
    st = gpu.status()
    if not st.available:
        raise SystemExit(f"no GPU: {st.detail}")
    info = gpu.device_info(0)
    res: dict = {"device": info.name, "type": args.type, "layers": args.layers}
    res["copy_GBps"] = round(copy_bandwidth(), 1)

    t0 = time.perf_counter()
    base = [
        make_pool(args.type, HIDDEN, FFN, 1),
        make_pool(args.type, HIDDEN, FFN, 2),
        make_pool(args.type, FFN, HIDDEN, 3),
    ]
    layers = [base]
    for _ in range(args.layers - 1):  # every layer its own memory, same bytes
        copies = []
        for p in base:
            q = gpu.ExpertPool(args.type, p.k, p.n, EXPERTS)
            q.tensor.copy_(p.tensor)
            copies.append(q)
        layers.append(copies)
    torch.cuda.synchronize()
    res["setup_s"] = round(time.perf_counter() - t0, 1)
    expert_bytes = sum(p.matrix_nbytes for p in base)  # gate + up + down of one expert
    res["pool_GiB"] = round(args.layers * sum(p.tensor.numel() for p in base) / 2**30, 2)

    # 1. One expert_matmul (the gate projection of 8 experts) per Python call.
    gate = base[0]
    calls = {}
    for t in (1, 8):
        x = torch.randn(t, HIDDEN, device="cuda")
        ids, _ = route(t, 5)
        out = torch.empty(t, TOP_K, FFN, device="cuda")
        for check in (False, True):
            us = wall_per_call(
                lambda x=x, ids=ids, out=out, check=check: gpu.expert_matmul(
                    gate, x, ids, out=out, check_ids=check
                ),
                200,
            )
            calls[f"T{t}{'_checked' if check else ''}"] = round(us, 1)
    res["expert_matmul_us_per_call"] = calls

    # 2. moe_layer eagerly, all layers, per layer.
    eager = {}
    for t in (1, 8, 64, 512):
        x = torch.randn(t, HIDDEN, device="cuda") * 0.5
        ids, w = route(t, 6)
        out = torch.empty(t, HIDDEN, device="cuda")

        def step(x=x, ids=ids, w=w, out=out):
            for g_, u_, d_ in layers:
                gpu.moe_layer(g_, u_, d_, x, ids, w, out=out, check_ids=False)

        us = wall_per_call(step, 3) / args.layers
        flops = 2 * t * TOP_K * 3 * HIDDEN * FFN
        eager[f"T{t}"] = {"us_per_layer": round(us, 1), "TFLOPs": round(flops / us / 1e6, 2)}
    res["moe_layer_eager"] = eager

    # 3. The decode step's MoE layers as one CUDA graph.
    x = torch.randn(1, HIDDEN, device="cuda") * 0.5
    ids, w = route(1, 7)
    out = torch.empty(1, HIDDEN, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            for g_, u_, d_ in layers:
                gpu.moe_layer(g_, u_, d_, x, ids, w, out=out, check_ids=False)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        for g_, u_, d_ in layers:
            gpu.moe_layer(g_, u_, d_, x, ids, w, out=out, check_ids=False)
    times = []
    for _ in range(20):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    us_step = statistics.median(times[3:])
    us_layer = us_step / args.layers
    bytes_layer = TOP_K * expert_bytes
    res["decode_graph"] = {
        "us_per_step": round(us_step, 1),
        "us_per_layer": round(us_layer, 2),
        "moe_only_tokens_per_s": round(1e6 / us_step, 1),
        "expert_MB_per_layer": round(bytes_layer / 1e6, 2),
        "GBps": round(bytes_layer / us_layer / 1e3, 1),
    }
    res["peak_alloc_GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)

    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"\n| {info.name} | {args.type} | {args.layers} layers |")
    print(f"copy bandwidth {res['copy_GBps']} GB/s")
    print(f"expert_matmul per Python call (us): {calls}")
    for t, r in eager.items():
        print(f"moe_layer eager {t}: {r['us_per_layer']} us/layer, {r['TFLOPs']} TFLOP/s")
    d = res["decode_graph"]
    print(
        f"decode MoE graph: {d['us_per_layer']} us/layer, {d['us_per_step']} us/step "
        f"({d['moe_only_tokens_per_s']} t/s MoE only), {d['GBps']} GB/s"
    )


if __name__ == "__main__":
    main()
