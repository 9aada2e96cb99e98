"""Would torch.compile close the CPU small gap (#5)? One thread, the e2e job's small model in fp32, a forward +
backward over 32 packed sequences of 18 tokens (about the actor update's batch), eager (grouped-mm and per-expert
loop experts) against `torch.compile` of the whole step. CPU `_grouped_mm` has no fp32 meta kernel under compile,
so the compiled step uses the loop experts; their data-dependent token counts split the graph.

    python benchmarks/cpu_compile_probe.py
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch._dynamo

from moeloop.model.factory import init_model
from moeloop.model.hf_io import load_pretrained


def main() -> None:
    torch.set_num_threads(1)
    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    model_dir = Path(tempfile.mkdtemp()) / "small"
    init_model("qwen3_moe", "small", model_dir, seed=0)
    model = load_pretrained(str(model_dir), dtype=torch.float32)
    lengths = [18] * 32
    ids = torch.randint(0, model.cfg.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(0))

    def step(m: torch.nn.Module) -> torch.Tensor:
        logits = m.compute_logits(m.forward_packed(ids, lengths))
        loss = torch.log_softmax(logits.float(), -1).gather(1, ids[:, None]).mean()
        loss.backward()
        return loss

    def median_ms(fn, n: int = 15) -> float:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times[3:]) * 1e3

    print(f"eager, grouped-mm experts: {median_ms(lambda: step(model)):.1f} ms per forward + backward")
    model.set_experts_impl("loop")
    print(f"eager, loop experts:       {median_ms(lambda: step(model)):.1f} ms")
    compiled = torch.compile(step)
    start = time.perf_counter()
    compiled(model)
    print(f"compiled, loop experts:    first call {time.perf_counter() - start:.1f} s, then "
          f"{median_ms(lambda: compiled(model)):.1f} ms")
    explained = torch._dynamo.explain(step)(model)
    print(f"graphs {explained.graph_count}, graph breaks {explained.graph_break_count}")


if __name__ == "__main__":
    main()
