"""Without CUDA, Triton kernels (when triton is installed) run under its CPU interpreter. The variable must be set
before the first `triton.jit` decoration, i.e. before any test module imports moeloop.rollout.
Without CUDA the test process also runs torch on one intra-op thread (as tests/dist.py's ranks do; OMP_NUM_THREADS
overrides): the tiny models' ops are too small to gain from a second thread, and when the CI's 2 cores are busy
with anything else, the thread pool's barriers stall every op (a tiny grouped_mm: 0.06 ms on 1 thread, 15 ms on 2
beside one busy process; test_the_reference_moves_toward_the_actor_and_resumes: 55-112 s against 5-6 s).
numpy's OpenBLAS gets one thread too (before `import torch` loads it; OMP_NUM_THREADS overrides): the interpreter's
tl.dot is an np.matmul of one tile, and OpenBLAS's spinning threads beside a busy process made the grouped expert
GEMM tests 1.7-3x slower (grouped_experts of 300 tokens: 4 s on 1 thread, 7-9 s on 2, up to 40 s on a loaded box).
The interpreter patches triton.language for a kernel's launch, and again (never undone) on every call of a
`@triton.jit` device function inside it, once per program: `interpreted_device_calls_skip_repatching` drops the
repeats (2 ms a call; pdl_wait, _silu, tl.sum, ... in every program: a third of the interpreted tests' time)."""
import os
import threading

if "OMP_NUM_THREADS" not in os.environ:
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import torch  # noqa: E402  (after the thread settings: it loads numpy)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def interpreted_device_calls_skip_repatching() -> None:
    """Inside a launch (`GridExecutor.__call__`), `_patch_lang` for a device function whose triton.language modules
    the launch already patched returns an empty scope: the same builtins stay patched, and the launch's own restore
    undoes them as before. Anything else (another triton, no interpreter) is left as it is."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    real_patch, real_launch = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    if real_patch is None or real_launch is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    real_launch_call = real_launch.__call__
    here = threading.local()  # (what the launch running on this thread patched)

    def langs(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    def patch_lang(fn):
        mine = langs(fn)
        patched = getattr(here, "patched", None)
        if patched is not None and mine <= patched:
            return interpreter._LangPatchScope()
        scope = real_patch(fn)
        if getattr(here, "launching", False):  # (a device function's patch is never undone: it holds for the launch)
            here.patched = mine | (patched or frozenset())
        return scope

    def launch(self, *args, **kwargs):
        here.launching, here.patched = True, None
        try:
            return real_launch_call(self, *args, **kwargs)
        finally:
            here.launching, here.patched = False, None

    interpreter._patch_lang = patch_lang
    real_launch.__call__ = launch


if os.environ.get("TRITON_INTERPRET") == "1":
    interpreted_device_calls_skip_repatching()
