"""The spread of the device copy bandwidth that `rollout.py` divides by: 20 timed 2 GiB copies (CUDA events), the
old median of 5 (host timer) and `copy_bandwidth_bytes_per_s`, three times in one process."""
import sys, statistics, time, torch
sys.path.insert(0, "benchmarks")
import rollout
for rep in range(3):
    n = 2 << 30
    src = torch.randn(n // 4, device="cuda"); dst = torch.empty_like(src); dst.copy_(src)
    ev = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); dst.copy_(src); b.record(); b.synchronize(); ev.append(2 * n / (a.elapsed_time(b) / 1e3) / 1e9)
    old = []
    for _ in range(5):
        torch.cuda.synchronize(); t = time.perf_counter(); dst.copy_(src); torch.cuda.synchronize(); old.append(time.perf_counter() - t)
    print(f"events GB/s: min {min(ev):.0f} median {statistics.median(ev):.0f} max {max(ev):.0f} | old median-of-5 {2 * n / statistics.median(old) / 1e9:.0f} | new fn {rollout.copy_bandwidth_bytes_per_s('cuda') / 1e9:.0f}")
    del src, dst
