"""Host time of a hybrid forward of a short tail on CUDA, eager and through the tail graphs: the tiny shape's
device work is negligible, so the time is the kernel launches a tail forward costs per layer (a cross-replica
resume computes up to one chunk after the checkpoint). Prints the host enqueue and total time for 256 tokens and
for 1 eagerly, the same 256 tokens through the tail graphs (kvshare.engine.hybrid_tail_graph, as the engine runs a
resumed tail), and the kernels and CPU time per op of one eager 256-token forward.

    python3 benchmarks/hybrid_tail_launch.py        (on the GPU machine, fla-core installed)
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine


def main() -> None:
    engine = Engine(EngineConfig(model="qwen3.5-tiny", device="cuda", max_model_len=4096))
    model, kv = engine.model, engine._tails.kv  # the KV the decode and tail graphs were captured with
    ids = torch.randint(0, 200, (2048,), device="cuda")
    with torch.inference_mode():
        model(ids[:1792], kv, 0)
        prefix = model.state.snapshot()
        for n in (256, 1):
            times = []
            for _ in range(5):
                model.state.restore(prefix)
                torch.cuda.synchronize()
                started = time.perf_counter()
                model(ids[1792 : 1792 + n], kv, 1792)
                enqueued = time.perf_counter()
                torch.cuda.synchronize()
                times.append((enqueued - started, time.perf_counter() - started))
            print(f"{n} tokens: host enqueue ms", [round(a * 1e3, 2) for a, _ in times])
            print(f"{n} tokens: total ms", [round(b * 1e3, 2) for _, b in times])
        times = []
        for _ in range(5):
            model.state.restore(prefix)
            torch.cuda.synchronize()
            started = time.perf_counter()
            engine._tails.run(ids[1792:2048], 1792)
            enqueued = time.perf_counter()
            torch.cuda.synchronize()
            times.append((enqueued - started, time.perf_counter() - started))
        print("256 tokens through the tail graphs: host enqueue ms", [round(a * 1e3, 2) for a, _ in times])
        print("256 tokens through the tail graphs: total ms", [round(b * 1e3, 2) for _, b in times])
        model.state.restore(prefix)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            model(ids[1792:2048], kv, 1792)
            torch.cuda.synchronize()
    kernels = [event for event in prof.events() if event.device_type.name == "CUDA"]
    print("cuda kernels for 256 tokens:", len(kernels))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
