"""One-token (B=1) decode weight streams on the GPU: the fused decode's GEMV kernels at their tile choices and
candidate tilings, against the device copy bandwidth, in one run (reference Qwen3-MoE shapes, bf16).

    python benchmarks/b1_gemv.py [--quick]

Each case cycles through 16 weight copies (one per layer: 16 x the bytes is far beyond L2, as in a decode step),
captured in a CUDA graph and replayed, so the time per launch includes the in-graph gap to the next launch.
"% copy" = weight bytes per launch over the time, over the measured copy bandwidth (read + write).
"""
from __future__ import annotations

import argparse
import itertools

import torch

from moe_decode_kernels import copy_bandwidth, graph_time
from moeloop.rollout import fused_decode, moe_kernel
from moeloop.rollout.decode_kernel import triton

LAYERS = 16


def report(label: str, t: float, nbytes: int, bw: float) -> None:
    print(f"  {label:<44} {t * 1e6:6.2f} us  {nbytes / t / 1e12:5.2f} TB/s  {100 * nbytes / t / bw:5.1f}% copy")


if triton is not None:
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _gemv_pdl(x_ptr, w_ptr, out_ptr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                  PDL: tl.constexpr, EARLY: tl.constexpr):
        """Prototype: the weight tile is loaded before waiting on the previous kernel (PDL), then x. EARLY: the next
        kernel may launch as soon as every program here has started (not once each has waited)."""
        if EARLY:
            gdc_launch_dependents()
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        d = tl.arange(0, D_PAD)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * D + d[None, :], mask=d[None, :] < D, other=0.0)
        if PDL:
            gdc_wait()
            if not EARLY:
                gdc_launch_dependents()
        x = tl.load(x_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(out_ptr + n, tl.sum(w.to(tl.float32) * x[None, :], 1).to(out_ptr.dtype.element_ty))

    @triton.jit
    def _gate_up_pdl(x_ptr, w_ptr, ids_ptr, h_ptr, s_we, D: tl.constexpr, D_PAD: tl.constexpr, F: tl.constexpr,
                     BLOCK_F: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr, PRELOAD: tl.constexpr):
        """Prototype: waits first (the expert ids come from the kernel before), or PRELOAD: the ids (here constant;
        in the engine a prediction from the router logits, checked after the wait) and weights before the wait.
        Never EARLY in the engine (the down kernel after it reads the ids before its wait); here EARLY is allowed."""
        if EARLY:
            gdc_launch_dependents()
        if PDL and not PRELOAD:
            gdc_wait()
            if not EARLY:
                gdc_launch_dependents()
        s = tl.program_id(0)
        f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
        d = tl.arange(0, D_PAD)
        e = tl.load(ids_ptr + s).to(tl.int64)
        rows = w_ptr + e * s_we + f[:, None] * D + d[None, :]
        wg = tl.load(rows, mask=d[None, :] < D, other=0.0)
        wu = tl.load(rows + F * D, mask=d[None, :] < D, other=0.0)
        if PDL and PRELOAD:
            gdc_wait()
            if not EARLY:
                gdc_launch_dependents()
        x = tl.load(x_ptr + d, mask=d < D, other=0.0).to(tl.float32)
        g = tl.sum(wg.to(tl.float32) * x[None, :], 1)
        u = tl.sum(wu.to(tl.float32) * x[None, :], 1)
        tl.store(h_ptr + s * F + f, (g / (1 + tl.exp(-g)) * u).to(h_ptr.dtype.element_ty))

    @triton.jit
    def _down_pdl(h_ptr, w_ptr, ids_ptr, wts_ptr, y_ptr, s_we, D: tl.constexpr, F: tl.constexpr, K: tl.constexpr,
                  BLOCK_D: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
        """Prototype: [K * BLOCK_D, F] weight rows of the K experts loaded before the wait (ids are two kernels old)."""
        if EARLY:
            gdc_launch_dependents()
        r = tl.arange(0, K * BLOCK_D)
        k = r // BLOCK_D
        d = tl.program_id(0) * BLOCK_D + r % BLOCK_D
        f = tl.arange(0, F)
        e = tl.load(ids_ptr + k).to(tl.int64)
        w = tl.load(w_ptr + e[:, None] * s_we + d[:, None] * F + f[None, :])
        if PDL:
            gdc_wait()
            if not EARLY:
                gdc_launch_dependents()
        h = tl.load(h_ptr + k[:, None] * F + f[None, :]).to(tl.float32)
        part = tl.sum(w.to(tl.float32) * h, 1).to(y_ptr.dtype.element_ty).to(tl.float32) * tl.load(wts_ptr + k)
        out = tl.sum(tl.reshape(part, [K, BLOCK_D]), 0)
        tl.store(y_ptr + tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D), out.to(y_ptr.dtype.element_ty))


# chain modes: (PDL, EARLY trigger, gate_up PRELOAD)
CHAIN_MODES = {"no PDL": (False, False, False), "PDL": (True, False, False), "PDL early": (True, True, False),
               "PDL preload": (True, False, True), "PDL early+preload": (True, True, True)}


def chain(bw: float, D: int, F: int, E: int, K: int, sweep: bool) -> None:
    """16 layers of qkv -> o_proj -> gate_up -> down, each reading the last one's output, in each of CHAIN_MODES."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    wq = [torch.randn(2560, D, **bf) * 0.02 for _ in range(LAYERS)]
    wo = [torch.randn(D, D, **bf) * 0.02 for _ in range(LAYERS)]
    wgu = [torch.randn(E, 2 * F, D, **bf) * 0.02 for _ in range(LAYERS)]
    wd = [torch.randn(E, D, F, **bf) * 0.02 for _ in range(LAYERS)]
    ids = torch.randperm(E, device="cuda")[:K].view(-1)
    wts = torch.rand(K, device="cuda").softmax(-1)
    x = torch.randn(1, D, **bf)
    qkv, o, h = torch.empty(1, 2560, **bf), torch.empty(1, D, **bf), torch.empty(K, F, **bf)
    nbytes = (2560 * D + D * D + K * 3 * F * D) * 2
    d_pad = triton.next_power_of_2(D)
    configs = [(4, 8, 4, 8, 4, 4)] if not sweep else [
        (bn, wn, bf_, wf, bd, wd_) for bn in (2, 4) for wn in (4, 8) for bf_ in (2, 4) for wf in (4, 8)
        for bd in (2, 4) for wd_ in (2, 4)]
    print(f"chain of {LAYERS} x (qkv, o_proj, gate_up, down): {nbytes / 1e6:.2f} MB per layer")
    results = []
    for bn, wn, bfu, wfu, bd, wdn in configs:
        for mode, (pdl, early, preload) in CHAIN_MODES.items():
            if sweep and mode == "no PDL":
                continue
            kw = dict(PDL=pdl, EARLY=early, launch_pdl=pdl)

            def run() -> None:
                for i in range(LAYERS):
                    _gemv_pdl[(2560 // bn,)](x, wq[i], qkv, D=D, D_PAD=d_pad, BLOCK_N=bn, num_warps=wn, **kw)
                    _gemv_pdl[(D // bn,)](qkv, wo[i], o, D=D, D_PAD=d_pad, BLOCK_N=bn, num_warps=wn, **kw)
                    _gate_up_pdl[(K, F // bfu)](o, wgu[i], ids, h, wgu[i].stride(0), D=D, D_PAD=d_pad, F=F,
                                                BLOCK_F=bfu, PRELOAD=preload, num_warps=wfu, **kw)
                    _down_pdl[(D // bd,)](h, wd[i], ids, wts, x, wd[i].stride(0), D=D, F=F, K=K, BLOCK_D=bd,
                                          num_warps=wdn, **kw)
            t = graph_time(run, calls=4) / LAYERS
            results.append((t, mode, (bn, wn, bfu, wfu, bd, wdn)))
            if not sweep:
                report(f"layer chain {mode}", t, nbytes, bw)
    if sweep:
        for mode in CHAIN_MODES:
            for t, _, cfg in sorted(r for r in results if r[1] == mode)[:2]:
                report(f"{mode} (bn, w, bf, w, bd, w)={cfg}", t, nbytes, bw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--quick", action="store_true", help="only the kernels' own tile choices")
    ap.add_argument("--chain", action="store_true", help="only the PDL layer chain")
    ap.add_argument("--sweep", action="store_true", help="the chain's tile sweep")
    args = ap.parse_args()
    D, F, E, K = args.dim, 512, 64, 4
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"copy bandwidth {bw / 1e12:.2f} TB/s; {LAYERS} weight copies per case")
    torch.manual_seed(0)
    if args.chain:
        return chain(bw, D, F, E, K, args.sweep)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, D, **bf)
    for name, n_rows in (("qkv", 2560), ("o_proj", 1536), ("router", 64)):
        ws = [torch.randn(n_rows, D, **bf) * 0.02 for _ in range(LAYERS)]
        out = torch.empty(1, n_rows, **bf)
        nbytes = n_rows * D * 2
        print(f"{name}: [{n_rows}, {D}] weight, {nbytes / 1e6:.2f} MB")
        ref = x.float() @ ws[-1].float().T  # run() ends on the last copy
        tiles = [(16, 512, 4)] if args.quick else itertools.product((4, 8, 16, 32), (512, 2048), (4, 8))
        for block_n, block_d, warps in tiles:
            if n_rows % block_n:
                continue

            def run() -> None:
                for w in ws:
                    fused_decode._row_linear[(n_rows // block_n,)](x, w, w, w, out, N0=n_rows, N1=0, D=D,
                                                                   BLOCK_N=block_n, BLOCK_D=block_d, EARLY=False, PDL=False,
                                                                   num_warps=warps)
            run()
            err = float((out.float() - ref).abs().max())
            report(f"_row_linear BLOCK_N={block_n} BLOCK_D={block_d} w={warps}", graph_time(run) / LAYERS, nbytes, bw)
            assert err < 2e-2, err
        t = graph_time(lambda: [torch.mm(x, w.T, out=out) for w in ws]) / LAYERS
        report("cuBLAS mm", t, nbytes, bw)

    w_gu = [torch.randn(E, 2 * F, D, **bf) * 0.02 for _ in range(LAYERS)]
    w_d = [torch.randn(E, D, F, **bf) * 0.02 for _ in range(LAYERS)]
    ids = torch.randperm(E, device="cuda")[:K].view(1, K)
    wts = torch.rand(1, K, device="cuda").softmax(-1)
    h = torch.empty(K, F, **bf)
    y = torch.empty(1, D, **bf)
    nbytes = K * 2 * F * D * 2
    print(f"gate_up + SiLU*up: {K} experts x [{2 * F}, {D}], {nbytes / 1e6:.2f} MB")
    tiles = [(8, 512, 4)] if args.quick else itertools.product((2, 4, 8, 16), (512, 2048), (4, 8))
    ids_S = ids.view(-1)
    for block_f, block_d, warps in tiles:
        def run_gu() -> None:
            for w in w_gu:
                moe_kernel._gate_up_silu[(K, F // block_f)](x, w, ids_S, h, w.stride(0), w.stride(1), D=D, F=F, K=K,
                                                              BLOCK_F=block_f, BLOCK_D=block_d, LIBDEVICE=True,
                                                              PDL=False, num_warps=warps)
        report(f"_gate_up_silu BLOCK_F={block_f} BLOCK_D={block_d} w={warps}", graph_time(run_gu) / LAYERS, nbytes, bw)
    nbytes = K * F * D * 2
    print(f"down + weighted sum: {K} experts x [{D}, {F}], {nbytes / 1e6:.2f} MB")
    tiles = [(4, 512, 4)] if args.quick else itertools.product((2, 4, 8, 16, 32), (512,), (2, 4, 8))
    for block_d, block_f, warps in tiles:
        def run_down() -> None:
            for w in w_d:
                moe_kernel._down_combine[(1, D // block_d)](h, w, ids_S, wts, y, w.stride(0), w.stride(1), D=D, F=F,
                                                            K=K, K_PAD=K, BLOCK_D=block_d, BLOCK_F=block_f, EARLY=False, PDL=False,
                                                            num_warps=warps)
        report(f"_down_combine BLOCK_D={block_d} BLOCK_F={block_f} w={warps}", graph_time(run_down) / LAYERS, nbytes, bw)


if __name__ == "__main__":
    main()
