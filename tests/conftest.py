"""Without CUDA, Triton kernels (when triton is installed) run under its CPU interpreter. The variable must be set
before the first `triton.jit` decoration, i.e. before any test module imports moeloop.rollout.
Without CUDA the test process also runs torch on one intra-op thread (as tests/dist.py's ranks do; OMP_NUM_THREADS
overrides): the tiny models' ops are too small to gain from a second thread, and when the CI's 2 cores are busy
with anything else, the thread pool's barriers stall every op (a tiny grouped_mm: 0.06 ms on 1 thread, 15 ms on 2
beside one busy process; test_the_reference_moves_toward_the_actor_and_resumes: 55-112 s against 5-6 s).
numpy's OpenBLAS gets one thread too (before `import torch` loads it; OMP_NUM_THREADS overrides): the interpreter's
tl.dot is an np.matmul of one tile, and OpenBLAS's spinning threads beside a busy process made the grouped expert
GEMM tests 1.7-3x slower (grouped_experts of 300 tokens: 4 s on 1 thread, 7-9 s on 2, up to 40 s on a loaded box)."""
import os

if "OMP_NUM_THREADS" not in os.environ:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402  (after the thread settings: it loads numpy)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
