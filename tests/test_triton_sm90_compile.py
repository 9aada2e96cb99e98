"""Every Triton kernel compiles to an sm_90 (H100/H200) cubin with the reference model's shapes, on any machine:
Triton's compiler and ptxas need no GPU. The CPU tests check what the kernels compute (interpreter); this checks
that the GPU build of the same source goes through (a kernel that only the interpreter accepts fails here).
The compiles run in one child process without TRITON_INTERPRET (under it, @triton.jit gives interpreted
functions that cannot be compiled). Skipped without triton."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

D, F, E, K = 1536, 512, 64, 4  # reference Qwen3-MoE: hidden, expert width, experts, top-k
H, G, DH = 12, 4, 128  # query heads, kv heads, head dim


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-c", "import tests.test_triton_sm90_compile as t; t.compile_all()"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def compile_all() -> None:
    """In the child: every `_compile_*` function below; the failures are listed together."""
    failed = []
    for name, fn in sorted(globals().items()):
        if name.startswith("_compile_"):
            try:
                fn()
            except Exception as err:  # noqa: BLE001 (collect every kernel's failure, then fail once)
                failed.append(f"{name}: {type(err).__name__}: {err}")
    if failed:
        sys.exit("\n".join(failed))


def compile_sm90(kernel, types: dict[str, str], consts: dict, num_warps: int = 4, num_stages: int = 3,
                 enable_fp_fusion: bool = True, enable_reflect_ftz: bool = True, divisible: bool = False):
    """`types`: the non-constexpr arguments' Triton types; `consts`: the constexpr values (defaults where left out).
    `divisible`: every typed argument specialised as divisible by 16, as a launch with aligned pointers and strides
    is (vectorised loads; `benchmarks/sass_order.py`). Returns the compiled kernel (its `.asm` holds the PTX)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    # defaults: a constexpr's value, or an optional pointer left as None (a constexpr None)
    consts = {**{p.name: p.default for p in kernel.params if p.has_default and p.name not in types}, **consts}
    signature = {name: types.get(name, "constexpr") for name in kernel.arg_names}
    assert set(signature) - set(types) == set(consts), "every argument: typed, a constexpr, or has a default"
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in types} if divisible else None
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages,
                                       "enable_fp_fusion": enable_fp_fusion,
                                       "enable_reflect_ftz": enable_reflect_ftz})
    assert compiled.asm["cubin"]
    return compiled


def _compile_expert_gemm():
    from moeloop.rollout import moe_kernel
    for gated in (True, False):
        compile_sm90(moe_kernel._expert_gemm,
                     dict(a_ptr="*bf16", rows_ptr="*i64", w_ptr="*bf16", offsets_ptr="*i32", out_ptr="*bf16",
                          s_we="i64", s_wn="i64"),
                     dict(N_OUT=F if gated else D, K_IN=D if gated else F, GATED=gated, GATHER=gated, BLOCK_M=32,
                          BLOCK_N=64, BLOCK_K=128, PRECISION="tf32", STATIC_M=0, M_SPLITS=4, LIBDEVICE=True, PDL=gated))


def _compile_align_and_small_batch_experts():
    from moeloop.rollout import moe_kernel
    compile_sm90(moe_kernel._align_by_expert, dict(ids_ptr="*i64", token_ptr="*i64", dest_ptr="*i64",
                                                   offsets_ptr="*i32", S="i32"), dict(K=K, S_PAD=1024, PDL=True))
    compile_sm90(moe_kernel._gate_up_silu, dict(x_ptr="*bf16", w_ptr="*bf16", ids_ptr="*i64", h_ptr="*bf16",
                                                s_we="i64", s_wf="i64"),
                 dict(D=D, F=F, K=K, BLOCK_F=4, BLOCK_D=2048, LIBDEVICE=True, PDL=True), num_warps=8)
    compile_sm90(moe_kernel._down_combine, dict(h_ptr="*bf16", w_ptr="*bf16", ids_ptr="*i64", wts_ptr="*fp32",
                                               y_ptr="*bf16", s_we="i64", s_wd="i64"),
                 dict(D=D, F=F, K=K, K_PAD=K, BLOCK_D=4, BLOCK_F=512, EARLY=True, PDL=True))
    # the route fold: both read the router's bf16 logits [T, E] and rank them
    compile_sm90(moe_kernel._gate_up_silu, dict(x_ptr="*bf16", w_ptr="*bf16", ids_ptr="*bf16", h_ptr="*bf16",
                                                s_we="i64", s_wf="i64"),
                 dict(D=D, F=F, K=K, BLOCK_F=4, BLOCK_D=2048, LIBDEVICE=True, PDL=True, ROUTED=True, E=E, E_PAD=E),
                 num_warps=8)
    compile_sm90(moe_kernel._down_combine, dict(h_ptr="*bf16", w_ptr="*bf16", ids_ptr="*bf16", y_ptr="*bf16",
                                               s_we="i64", s_wd="i64"),
                 dict(wts_ptr=None, D=D, F=F, K=K, K_PAD=K, BLOCK_D=4, BLOCK_F=512, EARLY=True, PDL=True, ROUTED=True,
                      E=E, E_PAD=E, SCALE=1.0, NORM=True))


def _compile_composed_router():
    """`ROUTER_COMPOSE`: o_proj + the raw router logits in one launch (1 router row a program, the default, and 4;
    at `O_PROJ_TILE`'s warps, 2, and 4); gate_up ranking those logits and norming the residual row; down scaling them
    by the row's 1 / RMS."""
    from moeloop.rollout import fused_decode, moe_kernel
    for block_e, warps in ((1, fused_decode.O_PROJ_TILE[1]), (1, 4), (4, 4)):
        compiled = compile_sm90(fused_decode._row_linear_router,
                                dict(a_ptr="*bf16", h_ptr="*bf16", w_ptr="*bf16", x_ptr="*bf16", r_ptr="*fp32",
                                     z_ptr="*fp32"),
                                dict(N=D, A=H * DH, D=D, E=E, BLOCK_N=fused_decode.O_PROJ_TILE[0], BLOCK_A=2048,
                                     BLOCK_D=2048, BLOCK_E=block_e, EARLY=True, PDL=True), num_warps=warps)
        ptx = compiled.asm["ptx"]  # one wait in each branch (o_proj rows, router rows), one early trigger
        assert ptx.count("griddepcontrol.wait") == 2 and ptx.count("griddepcontrol.launch_dependents") == 1
    compile_sm90(moe_kernel._gate_up_silu, dict(x_ptr="*bf16", w_ptr="*bf16", ids_ptr="*fp32", h_ptr="*bf16",
                                                s_we="i64", s_wf="i64", nw_ptr="*bf16", eps="fp32"),
                 dict(D=D, F=F, K=K, BLOCK_F=8, BLOCK_D=2048, LIBDEVICE=True, PDL=True, ROUTED=True, E=E, E_PAD=E,
                      COMPOSED=True))
    compile_sm90(moe_kernel._down_combine, dict(h_ptr="*bf16", w_ptr="*bf16", ids_ptr="*fp32", y_ptr="*bf16",
                                               s_we="i64", s_wd="i64", x_ptr="*bf16", eps="fp32"),
                 dict(wts_ptr=None, D=D, F=F, K=K, K_PAD=K, BLOCK_D=4, BLOCK_F=512, EARLY=True, PDL=True, ROUTED=True,
                      E=E, E_PAD=E, SCALE=1.0, NORM=True, COMPOSED=True, BLOCK_X=2048))


def _compile_combine_rows_and_backward():
    from moeloop.model import expert_rows
    for weighted in (True, False):
        compile_sm90(expert_rows._combine_rows, dict(y_ptr="*bf16", dest_ptr="*i64", out_ptr="*bf16",
                                                     wts_ptr="*fp32" if weighted else "*i64"),
                     dict(D=D, K=K, BLOCK_D=1024, WEIGHTED=weighted))
    compile_sm90(expert_rows._combine_rows_backward,
                 dict(g_ptr="*bf16", y_ptr="*bf16", dest_ptr="*i64", wts_ptr="*fp32", grad_y_ptr="*bf16",
                      grad_w_ptr="*fp32"), dict(D=D, K=K, BLOCK_D=2048), num_warps=8)


def _compile_fused_decode_kernels():
    from moeloop.rollout import fused_decode
    for combine_k in (0, K):
        compile_sm90(fused_decode._add_rmsnorm,
                     dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", res_out_ptr="*bf16",
                          dest_ptr="*i64", wts_ptr="*fp32", eps="fp32"),
                     dict(D=D, BLOCK_D=2048, HAS_RES=True, COMBINE_K=combine_k, PDL=combine_k > 0))
    for preload in (False, True):  # (`QK_PRELOAD`: the position, slot and cos/sin row before the wait)
        compiled = compile_sm90(fused_decode._qk_norm_rope_store,
                                dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", qw_ptr="*bf16", kw_ptr="*bf16",
                                     cos_ptr="*bf16", sin_ptr="*bf16", pos_ptr="*i64", slots_ptr="*i64",
                                     qo_ptr="*bf16", kc_ptr="*bf16", vc_ptr="*bf16", eps="fp32", s_q="i64",
                                     s_k="i64", s_v="i64", s_kc="i64", s_vc="i64"),
                                dict(H=H, G=G, HALF=DH // 2, QK_NORM=True, PDL=True, PRELOAD=preload), num_warps=1,
                                enable_fp_fusion=False)
        assert "fma.rn" not in compiled.asm["ptx"]  # as launched: 12 FMAs with fusion on, each skipping a rounding
    compile_sm90(fused_decode._softmax_topk, dict(logits_ptr="*bf16", ids_ptr="*i64", wts_ptr="*fp32", scale="fp32"),
                 dict(E=E, E_PAD=E, K=K, NORM=True, PDL=True), num_warps=1)
    for splits in (1, 3, 6):
        compile_sm90(fused_decode._router_topk, dict(x_ptr="*bf16", w_ptr="*bf16", ids_ptr="*i64", wts_ptr="*fp32",
                                                     scale="fp32", T="i32", part_ptr="*fp32", done_ptr="*i32"),
                     dict(D=D, E=E, E_PAD=E, K=K, NORM=True, BLOCK_T=fused_decode.ROUTER_TOPK_TILE[0],
                          BLOCK_D=fused_decode.ROUTER_TOPK_TILE[1], PRECISION="tf32", SPLITS=splits,
                          D_SPLIT=D // splits, PDL=True),
                     num_warps=fused_decode.ROUTER_TOPK_TILE[2], num_stages=fused_decode.ROUTER_TOPK_TILE[3])


def _compile_paged_decode():
    from moeloop.rollout import decode_kernel
    strides = {name: "i64" for name in ("s_qb", "s_qh", "s_ks", "s_kg", "s_vs", "s_vg", "s_ob", "s_oh", "s_tb")}
    for splits, warps in ((1, decode_kernel.PAGED_WARPS), (4, decode_kernel.PAGED_WARPS),
                          (4, decode_kernel.PAGED_WARPS_ONE_ROW)):  # (one row: split programs)
        compile_sm90(decode_kernel._paged_decode,
                     dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*bf16" if splits == 1 else "*fp32",
                          m_ptr="*fp32", l_ptr="*fp32", tables_ptr="*i32", lens_ptr="*i32", scale="fp32", **strides),
                     dict(QH=H // G, QH_PAD=16, DK=DH, DK_PAD=DH, DV=DH, DV_PAD=DH, BLOCK_SIZE=16, BLOCK_N=64,
                          PRECISION="tf32", NUM_SPLITS=splits, CHUNK=256, DYNAMIC_LOOP=splits == 1, V_EARLY=splits > 1, EARLY=True,
                          PDL=splits > 1), num_warps=warps)
    for warps in (1, 2, 4):  # (`MERGE_WARPS` (1) and the values `b1_tiles.py` tries)
        compile_sm90(decode_kernel._merge_splits, dict(part_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", o_ptr="*bf16",
                                                       s_ob="i64", s_oh="i64"),
                     dict(H=H, DV=DH, DV_PAD=DH, NUM_SPLITS=4, SPLITS_PAD=4, EARLY=True, PDL=True), num_warps=warps)


_RECORD_TYPES = dict(out_ptr="*fp64", s_out="i64", rec_k="i32", rec_steps="i32", ids_ptr="*i64", pos_ptr="*i64",
                     slots_ptr="*i64", lens_ptr="*i64", tables_ptr="*i64", s_tb="i64")


def _record_consts(advance: bool) -> dict:
    return dict(BLOCK_SIZE=16, RECORD=True, HAS_LOGPROBS=True, ADVANCE=advance, EARLY=True, PDL=True)


def _compile_gumbel_kernels():
    from moeloop.rollout import gumbel_kernel
    compile_sm90(gumbel_kernel._gumbel_sample, dict(logits_ptr="*bf16", keys_ptr="*i64", temps_ptr="*fp32",
                                                    score_ptr="*fp32", zs_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32",
                                                    idx_ptr="*i32", done_ptr="*i32", tokens_ptr="*i64",
                                                    logprobs_ptr="*fp32", s_lb="i64"),
                 dict(V=32000, SPLIT_V=4096, BLOCK_V=1024, S=8, S_PAD=8, LIBDEVICE=True))
    # multi-step decode's draw: the record and next inputs from the row's last program, under PDL
    for advance in (False, True):
        compiled = compile_sm90(gumbel_kernel._gumbel_sample, dict(
            logits_ptr="*bf16", keys_ptr="*i64", temps_ptr="*fp32", score_ptr="*fp32", zs_ptr="*fp32", m_ptr="*fp32",
            l_ptr="*fp32", idx_ptr="*i32", done_ptr="*i32", tokens_ptr="*i64", logprobs_ptr="*fp32", s_lb="i64",
            **_RECORD_TYPES), dict(V=32000, SPLIT_V=4096, BLOCK_V=1024, S=8, S_PAD=8, LIBDEVICE=True,
                                   **_record_consts(advance)))
        assert "griddepcontrol.wait" in compiled.asm["ptx"]
    compile_sm90(gumbel_kernel._topk_gumbel, dict(vals_ptr="*fp32", ids_ptr="*i64", keys_ptr="*i64", temps_ptr="*fp32",
                                                  top_ks_ptr="*i64", drop_ptr="*i8", out_ptr="*i64", N="i32"),
                 dict(BLOCK_N=64, HAS_DROP=True, LIBDEVICE=True))


def _compile_topk_sample():
    from moeloop.rollout import topk_kernel
    types = dict(keys_ptr="*i64", temps_ptr="*fp32", top_ks_ptr="*i64", m_ptr="*fp32", l_ptr="*fp32", cnt_ptr="*i32",
                 cand_z_ptr="*fp32", cand_v_ptr="*i32", done_ptr="*i32", tokens_ptr="*i64", logprobs_ptr="*fp32",
                 s_lb="i64", max_top_k="i32")
    # the benchmark's bf16 top-k 50 (16 bisection steps; 8 warps for one row), fp32 logits (32 steps), the largest
    # top-k (256 slots)
    for dtype, key_bits, slots, warps in (("bf16", 16, 64, 4), ("bf16", 16, 64, 8), ("fp32", 32, 64, 4),
                                          ("bf16", 16, 256, 8)):
        compiled = compile_sm90(topk_kernel._topk_sample, dict(logits_ptr=f"*{dtype}", **types),
                                dict(V=32000, S=16, S_PAD=16, BLOCK_V=2048, C=slots, KEY_BITS=key_bits,
                                     LIBDEVICE=True), num_warps=warps)
        assert "atom.global.gpu.acq_rel.add" in compiled.asm["ptx"]  # the row's ticket, after a bar.sync
    # with top-p: the fp64 slice sums and the nucleus mass (top-k 50 and the largest, 256)
    for dtype, slots, warps in (("bf16", 64, 4), ("bf16", 256, 8), ("fp32", 64, 4)):
        compiled = compile_sm90(topk_kernel._topk_sample, dict(logits_ptr=f"*{dtype}", top_ps_ptr="*fp32",
                                                                 l64_ptr="*fp64", **types),
                                dict(V=32000, S=16, S_PAD=16, BLOCK_V=2048, C=slots,
                                     KEY_BITS=16 if dtype == "bf16" else 32, LIBDEVICE=True, TOP_P=True, N_PAD=slots,
                                     J=16), num_warps=warps)
        assert ".f64" in compiled.asm["ptx"]
    for top_p in ({}, dict(top_ps_ptr="*fp32", l64_ptr="*fp64")):  # `TOPK_SHORT`: while-loop bisections
        compile_sm90(topk_kernel._topk_sample, dict(logits_ptr="*bf16", **types, **top_p),
                     dict(V=32000, S=16, S_PAD=16, BLOCK_V=2048, C=64, KEY_BITS=16, LIBDEVICE=True, SHORT=True,
                          **(dict(TOP_P=True, N_PAD=64, J=16) if top_p else {})), num_warps=8)
    for top_p, warps in (({}, 8), ({}, 4), (dict(top_ps_ptr="*fp32", l64_ptr="*fp64"), 8)):  # `TOPK_GROUPS`
        compile_sm90(topk_kernel._topk_sample, dict(logits_ptr="*bf16", **types, **top_p),
                     dict(V=32000, S=16, S_PAD=16, BLOCK_V=2048, C=128, KEY_BITS=16, LIBDEVICE=True, SHORT=True,
                          GROUPS=128, **(dict(TOP_P=True, N_PAD=64, J=16) if top_p else {})), num_warps=warps)
    for advance in (False, True):  # multi-step decode's top-k 50 draw with its record, under PDL
        compiled = compile_sm90(topk_kernel._topk_sample, dict(logits_ptr="*bf16", **types, **_RECORD_TYPES),
                                dict(V=32000, S=16, S_PAD=16, BLOCK_V=2048, C=64, KEY_BITS=16, LIBDEVICE=True,
                                     **_record_consts(advance)))
        assert "griddepcontrol.launch_dependents" in compiled.asm["ptx"]
    # `TOPK_READS_EARLY`: phase 2 reads every candidate slot with the counts (the benchmark's B=1 top-k 50 launch)
    compile_sm90(topk_kernel._topk_sample, dict(logits_ptr="*bf16", **types, **_RECORD_TYPES),
                 dict(V=32000, S=16, S_PAD=16, BLOCK_V=2048, C=128, KEY_BITS=16, LIBDEVICE=True, SHORT=True,
                      GROUPS=128, READS_EARLY=True, **_record_consts(True)), num_warps=8)
    ranked = {k: v for k, v in types.items() if k not in ("keys_ptr", "temps_ptr", "top_ks_ptr", "tokens_ptr",
                                                          "logprobs_ptr", "max_top_k")}
    for n_pad, slots, warps in ((64, 64, 4), (256, 256, 8)):  # the top-p path's ranked candidates
        compile_sm90(topk_kernel._ranked_candidates, dict(logits_ptr="*bf16", vals_ptr="*bf16", ids_ptr="*i64",
                                                            n="i32", **ranked),
                     dict(V=32000, S=16, S_PAD=16, BLOCK_V=2048, C=slots, N_PAD=n_pad, J=64, KEY_BITS=16),
                     num_warps=warps)


def _compile_rmsnorm():
    from moeloop.model import norm
    for dim in (D, DH):  # the layer norms and the per-head q/k norms
        block_d, block_r = norm._row_block(dim)
        compile_sm90(norm._rmsnorm_fwd, dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", rstd_ptr="*fp32", eps="fp32",
                                             R="i32"), dict(D=dim, BLOCK_D=block_d, BLOCK_R=block_r))
        compile_sm90(norm._rmsnorm_bwd, dict(dy_ptr="*bf16", x_ptr="*bf16", w_ptr="*bf16", rstd_ptr="*fp32",
                                             dx_ptr="*bf16", dw_ptr="*fp32", R="i32"),
                     dict(D=dim, BLOCK_D=block_d, ROWS=32, BLOCK_R=min(block_r, 32)))


def _compile_logprob_chunk_kernels():
    from moeloop.model import logprob_kernels as lk
    vocab = 32000
    for with_entropy in (True, False):
        compile_sm90(lk._chunk_stats, dict(z_ptr="*fp32", labels_ptr="*i64", lse_ptr="*fp32", picked_ptr="*fp32",
                                           ent_ptr="*fp32", inv_temp="fp32"),
                     dict(V=vocab, BLOCK_V=lk.BLOCK_V, WITH_ENTROPY=with_entropy))
        compile_sm90(lk._chunk_dlogits, dict(z_ptr="*fp32", dz_ptr="*bf16", labels_ptr="*i64", g_lp_ptr="*fp32",
                                             g_ent_ptr="*fp32", lse_ptr="*fp32", ent_ptr="*fp32", inv_temp="fp32"),
                     dict(V=vocab, BLOCK_V=lk.BLOCK_V, HAS_ENTROPY=with_entropy))


def _compile_row_linear():
    from moeloop.rollout import fused_decode
    # q|k|v, o_proj (when the router is not composed) and the router (when its norm is not folded), all at
    # ROW_LINEAR_TILE as `project` launches them
    block_n, warps = fused_decode.ROW_LINEAR_TILE
    for n0, n1 in ((H * DH, G * DH), (D, 0), (E, 0)):
        for pdl, early in ((False, False), (False, True), (True, False), (True, True)):
            compiled = compile_sm90(fused_decode._row_linear, dict(x_ptr="*bf16", w0_ptr="*bf16", w1_ptr="*bf16", w2_ptr="*bf16",
                                                        out_ptr="*bf16"),
                         dict(N0=n0, N1=n1, D=D if n0 != D else H * DH, BLOCK_N=block_n, BLOCK_D=2048, EARLY=early,
                              PDL=pdl), num_warps=warps)
            # the PDL build waits on the previous grid and releases the next one (once: EARLY before the weight
            # loads and the wait, else after the wait); the plain build does neither
            ptx = compiled.asm["ptx"]
            assert ptx.count("griddepcontrol.wait") == ptx.count("griddepcontrol.launch_dependents") == int(pdl)
            if pdl:
                first_load = ptx.index("ld.global")
                trigger, wait = ptx.index("griddepcontrol.launch_dependents"), ptx.index("griddepcontrol.wait")
                assert (trigger < first_load < wait) if early else (first_load < wait < trigger)


def _compile_norm_row_linear():
    from moeloop.rollout import fused_decode
    for n0, n1, has_res, write_y, embed in ((H * DH, G * DH, True, False, False), (H * DH, G * DH, False, False, False),
                                            (E, 0, True, True, False), (H * DH, G * DH, False, False, True)):
        tile = fused_decode.ROUTER_TILE if n0 == E else fused_decode.ROW_LINEAR_TILE  # the router's, or q|k|v's
        compile_sm90(fused_decode._norm_row_linear,
                     dict(x_ptr="*bf16", res_ptr="*i64" if embed else "*bf16", nw_ptr="*bf16", y_ptr="*bf16",
                          res_out_ptr="*bf16", w0_ptr="*bf16", w1_ptr="*bf16", w2_ptr="*bf16", out_ptr="*bf16",
                          eps="fp32"),
                     dict(N0=n0, N1=n1, D=D, BLOCK_N=tile[0], BLOCK_D=2048, HAS_RES=has_res, WRITE_Y=write_y,
                          EARLY=True, PDL=True, EMBED=embed),
                     num_warps=tile[1])


def _compile_lm_head_fold():
    from moeloop.rollout import fused_decode
    block_n, warps = fused_decode.LM_HEAD_TILE
    compile_sm90(fused_decode._norm_row_linear,
                 dict(x_ptr="*bf16", res_ptr="*bf16", nw_ptr="*bf16", y_ptr="*bf16", res_out_ptr="*bf16",
                      w0_ptr="*bf16", w1_ptr="*bf16", w2_ptr="*bf16", out_ptr="*bf16", eps="fp32"),
                 dict(N0=0, N1=0, D=D, BLOCK_N=block_n, BLOCK_D=2048, HAS_RES=True, WRITE_Y=False, EARLY=True,
                      PDL=True), num_warps=warps)


def _compile_rope_half_split():
    from moeloop.model import rope_kernel
    for heads in (H, G):  # q and k
        for backward in (False, True):
            compiled = compile_sm90(
                rope_kernel._rope_half_split,
                dict(x_ptr="*bf16", cos_ptr="*bf16", sin_ptr="*bf16", y_ptr="*bf16", num_rows="i32", s_xt="i32",
                     s_xh="i32"),
                dict(H=heads, R2=DH // 2, BLOCK_R2=DH // 2, BLOCK_ROWS=32, BACKWARD=backward, BY_BITS=False),
                enable_fp_fusion=False)
            # as launched: an FMA would merge a product into the add unrounded, off by a bf16 ulp from torch
            assert "fma.rn" not in compiled.asm["ptx"]


def _compile_swiglu():
    from moeloop.model import swiglu_kernel
    consts = dict(F=F, BLOCK_F=256, BLOCK_ROWS=8, BY_BITS=False, LIBDEVICE=True)
    for kernel, types in ((swiglu_kernel._swiglu_fwd, dict(h_ptr="*bf16", y_ptr="*bf16", num_rows="i32", s_h="i32")),
                          (swiglu_kernel._swiglu_bwd, dict(h_ptr="*bf16", dy_ptr="*bf16", dh_ptr="*bf16",
                                                           num_rows="i32", s_h="i32", s_dy="i32"))):
        ptx = compile_sm90(kernel, types, consts, num_warps=8, enable_fp_fusion=True,
                           enable_reflect_ftz=False).asm["ptx"]
        # as launched, the contractions nvcc makes in torch's silu kernels: every 1 + (product) is one FMA (expf's
        # final scaling; the backward's x * (1 - sig)); IEEE division (div.full would be ~2 ulps off)
        one = r"0f3F800000;"
        assert re.search(r"fma\.rn\.f32\s+%r\d+, %r\d+, %r\d+, " + one, ptx)
        assert not re.search(r"add(\.rn)?\.f32\s+%r\d+, %r\d+, " + one, ptx)
        assert "div.rn.f32" in ptx and "div.full" not in ptx


def _compile_record_advance():
    from moeloop.rollout import multistep
    for advance in (False, True):  # the last step of a launch records only
        compile_sm90(multistep._record_advance,
                     dict(tokens_ptr="*i64", logprobs_ptr="*fp32", out_ptr="*fp64", ids_ptr="*i64", pos_ptr="*i64",
                          lens_ptr="*i64", slots_ptr="*i64", tables_ptr="*i64", B="i32", s_out="i64", s_tb="i64",
                          k="i32", steps="i32"),
                     dict(BLOCK_SIZE=16, HAS_LOGPROBS=True, ADVANCE=advance, BLOCK_B=16))
