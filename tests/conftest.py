"""Without CUDA, Triton kernels (when triton is installed) run under its CPU interpreter. The variable must be set
before the first `triton.jit` decoration, i.e. before any test module imports moeloop.rollout.
Without CUDA the test process also runs torch on one intra-op thread (as tests/dist.py's ranks do; OMP_NUM_THREADS
overrides): the tiny models' ops are too small to gain from a second thread, and when the CI's 2 cores are busy
with anything else, the thread pool's barriers stall every op (a tiny grouped_mm: 0.06 ms on 1 thread, 15 ms on 2
beside one busy process; test_the_reference_moves_toward_the_actor_and_resumes: 55-112 s against 5-6 s)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
