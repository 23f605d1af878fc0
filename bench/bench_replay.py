"""Replay preparation of the ``triton`` backend (GPU only): all metadata of one step for a
captured DECODE / TARGET_VERIFY key (bs 64, kv 4096, page 16): host time (perf_counter
median) and device time (do_bench median); run under set_sync_debug_mode("error")."""
import random
import statistics
import time

import pytest
import torch
from bench_kernels import record

from attn_backends import ForwardMode, ModelConfig, get_backend
from attn_backends.check.scenarios import Scenario, make_memory, materialize, verify_spec


@pytest.mark.parametrize("mode", ["decode", "verify4"])
def test_replay_preparation(benchmark, mode):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    rng = random.Random(0)
    cfg = ModelConfig(num_layers=1, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                      dtype=torch.bfloat16)
    mem = make_memory(cfg, num_pages=2 * 64 * 4200 // 16 + 8, max_reqs=130, max_context_len=8192,
                      seed=0, device="cuda", fill=False)
    be = get_backend("triton", cfg, mem)
    spec = None if mode == "decode" else verify_spec(4, 64, rng, device="cuda")
    fm = ForwardMode.DECODE if mode == "decode" else ForwardMode.TARGET_VERIFY
    w = 1 if mode == "decode" else 4
    cap = materialize(Scenario(fm, 64, [4096 - w] * 64, spec=spec), mem, 1)
    rep = materialize(Scenario(fm, 64, [rng.randint(3000, 4096 - w) for _ in range(60)], spec=spec), mem, 1)
    be.init_cuda_graph_state(64, 64 * w)
    be.init_forward_metadata_capture_cuda_graph(cap.batch.graph_inputs())
    gi = rep.batch.graph_inputs()
    prep = lambda: be.init_forward_metadata_replay_cuda_graph(gi)  # noqa: E731
    for _ in range(20):
        prep()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    host = []
    try:
        for _ in range(300):
            t0 = time.perf_counter()
            prep()
            host.append((time.perf_counter() - t0) * 1e6)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    import triton
    dev_us = triton.testing.do_bench(prep, warmup=10, rep=40, return_mode="median") * 1e3
    host_us = statistics.median(host)
    benchmark.extra_info.update(host_us=host_us, device_us=dev_us)
    benchmark.pedantic(lambda: (prep(), torch.cuda.synchronize()), rounds=20, warmup_rounds=2)
    record({"kernel": f"replay_prep_{mode}", "impl": "triton", "host_us": host_us, "device_us": dev_us})
