"""Without CUDA, Triton kernels (when triton is installed) run under its CPU interpreter. The variable must be set
before the first `triton.jit` decoration, i.e. before any test module imports moeloop.rollout."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
