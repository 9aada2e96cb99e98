"""The fused decode forward (add+RMSNorm, q/k norm + RoPE + KV write, softmax top-k router kernels) equals the
module forward: same greedy tokens and logprobs through the engine (fp32), and logits within bf16 rounding
for a bf16 model. On CPU it runs under the Triton interpreter; skipped without triton."""
import os

import pytest
import torch
import torch.nn.functional as F

from moeloop.rollout import SamplingParams
from moeloop.rollout.decode_kernel import triton_available
from moeloop.rollout.fused_decode import fused_decode_forward, fused_supported
from moeloop.rollout.paged_attention import AttentionMetadata, PagedAttention
from tests.kernels import recorded_grids
from tests.test_rollout_engine import make_engine, prompts, tiny_model

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed (CPU torch wheel)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_kernels_match_module_path(model, ps: list, params: SamplingParams, after_ref=lambda: None) -> None:
    """Generate with the module path (on every device: on CUDA the kernels are the default), call `after_ref`, then
    with the kernels (decode-only steps take the fused forward; paged attention: the Triton kernel): the same
    tokens, and logprobs within 1e-5."""
    ref_engine = make_engine(model, enforce_eager=True)
    ref_engine.runner.use_kernel = False
    ref = ref_engine.generate(ps, params)
    after_ref()
    engine = make_engine(model, enforce_eager=True)
    engine.runner.use_kernel = True
    outs = engine.generate(ps, params)
    assert [o.response_ids for o in outs] == [o.response_ids for o in ref]
    for o, r in zip(outs, ref):
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(r.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "llama_tied"])
def test_fused_decode_engine_matches_module_path(arch):
    model = tiny_model(arch).to(DEVICE)
    assert fused_supported(model)
    assert_kernels_match_module_path(model, prompts(6, seed=12), SamplingParams(n=2, temperature=1.0, max_tokens=6,
                                                                                seed=4))


def test_fused_decode_forward_bf16_logits_and_kv():
    model = tiny_model("qwen3_moe").to(DEVICE, torch.bfloat16)
    engine = make_engine(model, enforce_eager=True)
    cache, bs = engine.cache, engine.cache.block_size
    B, ctx_len = 5, 9  # each row: 8 cached positions (random K/V) + the new token at position 8
    tables = torch.arange(B * 3, device=DEVICE, dtype=torch.int32).view(B, 3)
    for layer in range(len(cache.k)):
        cache.k[layer].normal_()
        cache.v[layer].normal_()
    slots = (tables[:, 8 // bs].long() * bs + 8 % bs)
    ids = torch.randint(3, 256, (B,), device=DEVICE)
    pos = torch.full((B,), 8, device=DEVICE)
    lens = torch.full((B,), ctx_len, dtype=torch.int32, device=DEVICE)

    def run(fused: bool):
        meta = AttentionMetadata(slots, None, tables, lens, ctx_len, [])
        ctx = PagedAttention(cache, meta, use_kernel=False)
        with torch.no_grad():
            hidden = fused_decode_forward(model, ids, pos, ctx) if fused else model(ids, pos, ctx)
        return model.compute_logits(hidden).float(), [k[slots].clone() for k in cache.k]

    ref_logits, ref_k = run(False)
    logits, k = run(True)
    torch.testing.assert_close(logits, ref_logits, atol=0.05, rtol=0.02)  # bf16: a norm's fp32 sum order differs
    # layer 0's K: every rounding point kept, so it is within a bf16 step or two (a norm's fp32 sum order can flip a
    # rounding, and k_proj spreads it). Not on CPU: the Triton interpreter does not round fp32 -> bf16 to nearest
    # as the GPU and torch do.
    if DEVICE == "cuda":
        torch.testing.assert_close(k[0].float(), ref_k[0].float(), atol=2 ** -8, rtol=2 ** -6)
    for a, b in zip(k[1:], ref_k[1:]):  # later layers inherit bf16-level differences of the residual stream
        torch.testing.assert_close(a.float(), b.float(), atol=0.1, rtol=0.05)
    assert (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("num_tokens,max_width", [(1, 2048), (3, 2048), (2, 32), (40, 2048), (300, 2048)])
def test_decode_expert_kernels_match_sorted_forward(monkeypatch, num_tokens, max_width):
    """The small-batch fused kernels and the grouped path (counting sort + grouped_mm + weighted sum) both equal
    `Experts.sorted_forward`; the counting sort gives the stable argsort's order and the grouped_mm offsets.
    max_width 32: the small-batch kernels hold narrower weight tiles than a row and loop over the rest."""
    from moeloop.model.experts import Experts, expert_counts
    from moeloop.rollout import moe_kernel
    from moeloop.rollout.moe_kernel import fused_experts, grouped_experts
    monkeypatch.setattr(moe_kernel, "FEW_MAX_WIDTH", max_width)

    torch.manual_seed(num_tokens)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # CUDA grouped_mm takes bf16
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    experts = Experts(8, 64, 32, "grouped_mm").to(DEVICE, dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
        x = torch.randn(num_tokens, 64, device=DEVICE, dtype=dtype)
        ids = torch.stack([torch.randperm(8, device=DEVICE)[:3] for _ in range(num_tokens)])
        wts = torch.rand(num_tokens, 3, device=DEVICE)
        ref = experts.sorted_forward(x, ids, wts, expert_counts(ids, 8))
        torch.testing.assert_close(fused_experts(experts, x, ids, wts), ref, **tol)
        for gemm in ("triton", "grouped_mm"):
            torch.testing.assert_close(grouped_experts(experts, x, ids, wts, gemm), ref, **tol, msg=lambda m: f"{gemm}: {m}")


@pytest.mark.parametrize("m_splits", [1, 4])
def test_grouped_expert_gemm_with_skewed_routing(monkeypatch, m_splits):
    """Every token picks expert 0 (as the n samples of one prompt tend to): its 300 rows span 5 row chunks, which
    M_SPLITS programs share (chunks j, j + M_SPLITS, ...); the output equals `Experts.sorted_forward`."""
    import moeloop.rollout.moe_kernel as moe_kernel
    from moeloop.model.experts import Experts, expert_counts
    monkeypatch.setattr(moe_kernel, "M_SPLITS", m_splits)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    experts = Experts(8, 64, 32, "grouped_mm").to(DEVICE, dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
        x = torch.randn(300, 64, device=DEVICE, dtype=dtype)
        ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(7)[:2]]) for _ in range(300)])
        ids, wts = ids.to(DEVICE), torch.rand(300, 3, device=DEVICE)
        ref = experts.sorted_forward(x, ids, wts, expert_counts(ids, 8))
        torch.testing.assert_close(moe_kernel.grouped_experts(experts, x, ids, wts, "triton"), ref, **tol)


def test_fused_failure_falls_back_to_module_forward(monkeypatch):
    """A fused decode forward that fails (say, a kernel that does not compile on this GPU) is switched off with a
    warning; decoding goes on through the module forward with the same outputs."""
    import moeloop.rollout.runner as runner

    model = tiny_model().to(DEVICE)
    ps = prompts(4, seed=13)
    ref = make_engine(model, enforce_eager=True).generate(ps, GREEDY_PARAMS)

    def broken(*a, **kw):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(runner, "fused_decode_forward", broken)
    monkeypatch.setattr(runner, "fused_decode_logits", broken)
    engine = make_engine(model, enforce_eager=True)
    engine.runner.use_kernel = True
    with pytest.warns(UserWarning, match="module forward"):
        outs = engine.generate(ps, GREEDY_PARAMS)
    assert not engine.runner.fused_ok
    assert [o.response_ids for o in outs] == [o.response_ids for o in ref]


GREEDY_PARAMS = SamplingParams(temperature=0, max_tokens=6)


@pytest.mark.parametrize("max_d", [2048, 16])
def test_row_linear_equals_f_linear(monkeypatch, max_d):
    """One token through up to three projections in one launch (the B=1 decode path) == F.linear of each.
    max_d 16: a program holds 16 weight columns at a time and loops over the 40 (the last block masked)."""
    from torch import nn
    from moeloop.rollout import fused_decode
    from moeloop.rollout.fused_decode import project, row_linear_applies

    monkeypatch.setattr(fused_decode, "ROW_LINEAR_MAX_D", max_d)
    torch.manual_seed(0)
    x = torch.randn(1, 40, device=DEVICE)
    mods = [nn.Linear(40, n, bias=False).to(DEVICE) for n in (48, 16, 32)]
    assert row_linear_applies(x, mods, 16)
    for got, m in zip(project(x, mods, block_n=16), mods):
        torch.testing.assert_close(got, F.linear(x, m.weight), rtol=1e-5, atol=1e-5)
    for got, m in zip(project(x, mods), mods):  # the default tile
        torch.testing.assert_close(got, F.linear(x, m.weight), rtol=1e-5, atol=1e-5)
    (one,) = project(x, mods[:1], block_n=8)
    torch.testing.assert_close(one, F.linear(x, mods[0].weight), rtol=1e-5, atol=1e-5)
    assert not row_linear_applies(torch.randn(2, 40, device=DEVICE), mods, 16)  # more tokens: cuBLAS
    assert not row_linear_applies(x, [nn.Linear(40, 16).to(DEVICE)], 16)  # a bias: the module path


@pytest.mark.parametrize("arch,norm_fold,route_fold,embed_fold,head_fold", [
    ("qwen3_moe", False, False, False, True), ("qwen3_moe", True, False, False, False),
    ("qwen3_moe", True, True, True, True), ("mixtral", True, True, True, True)])
def test_fused_decode_single_sequence_matches_module_path(monkeypatch, arch, norm_fold, route_fold, embed_fold,
                                                          head_fold):
    """B=1 decode takes the one-launch projections (with `norm_fold`, the add + RMSNorm folded into the q|k|v and
    router projections, and with `head_fold` the final one into the lm_head; with `route_fold` too, the softmax
    top-k done inside the expert kernels; with `embed_fold`, the first q|k|v launch reads the embedding row); same
    tokens and logprobs as the module forward (Mixtral: top-2 of 8 experts, no q/k norm)."""
    from moeloop.rollout import decode_packs, fused_decode, moe_kernel
    monkeypatch.setattr(decode_packs, "ROUTER_COMPOSE", False)  # the router's own launch (on CUDA, by default composed)
    monkeypatch.setattr(fused_decode, "NORM_FOLD", norm_fold)
    monkeypatch.setattr(moe_kernel, "ROUTE_FOLD", route_fold)
    monkeypatch.setattr(fused_decode, "EMBED_FOLD", embed_fold)
    monkeypatch.setattr(fused_decode, "LM_HEAD_FOLD", head_fold)
    folds, routed, embedded, heads = [], [], [], []
    fold, route = fused_decode.normed_row_linear, fused_decode.routed_experts

    def spy(*a, **k):
        if a[3] == [model.lm_head]:
            heads.append(k["tile"])
        else:
            folds.append(len(a[3]))
        embedded.append(k.get("ids_T") is not None)
        return fold(*a, **k)
    monkeypatch.setattr(fused_decode, "normed_row_linear", spy)
    monkeypatch.setattr(fused_decode, "routed_experts", lambda *a: routed.append(1) or route(*a))
    tiles = recorded_grids(monkeypatch, fused_decode, ("_norm_row_linear", "_row_linear"),
                           lambda name, grid, kw: (kw["N1"] > 0, kw["BLOCK_N"], kw["num_warps"]))

    def module_path_folds_nothing() -> None:
        assert not folds and not routed

    model = tiny_model(arch).to(DEVICE)
    assert_kernels_match_module_path(model, prompts(1, seed=5),
                                     SamplingParams(n=1, temperature=1.0, max_tokens=5, seed=2), module_path_folds_nothing)
    # per decode step and layer: q|k|v (3 projections) and the router (1)
    assert (sorted(set(folds)) == [1, 3] and len(folds) == 2 * 4 * len(model.model.layers)) if norm_fold else not folds
    assert len(routed) == (4 * len(model.model.layers) if route_fold else 0)
    assert sum(embedded) == (4 if embed_fold else 0)  # once per decode step
    assert heads == ([fused_decode.LM_HEAD_TILE] * 4 if head_fold and norm_fold else [])
    # the q|k|v launches (three projections) run ROW_LINEAR_TILE, folded or not: 8 rows, 4 warps (measured)
    assert {(rows, warps) for qkv, rows, warps in tiles if qkv} == {fused_decode.ROW_LINEAR_TILE}
    assert sum(qkv for qkv, _, _ in tiles) == 4 * len(model.model.layers)
    if "MOELOOP_ROW_LINEAR_TILE" not in os.environ:  # (an A/B run sets another tile)
        assert fused_decode.ROW_LINEAR_TILE == (8, 4)


@pytest.mark.parametrize("norm_topk", [True, False])
def test_routed_experts_equal_topk_kernel_then_experts(norm_topk):
    """The expert kernels ranking the router logits themselves (`routed_experts`) give what the top-k kernel's ids
    and weights give through `fused_experts`: logits with ties at the top-k boundary (lowest id first) and a NaN
    row (its experts stay in range; the other rows are unaffected)."""
    from types import SimpleNamespace
    from moeloop.model.experts import Experts
    from moeloop.rollout.fused_decode import route_softmax_topk
    from moeloop.rollout.moe_kernel import fused_experts, routed_experts

    torch.manual_seed(3)
    E, K, D, F_ = 12, 3, 64, 32  # E padded to 16 inside the kernels
    experts = Experts(E, D, F_, "grouped_mm").to(DEVICE)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.1)
        experts.down_proj.normal_(0, 0.1)
    gate = SimpleNamespace(top_k=K, routed_scaling_factor=2.5, norm_topk_prob=norm_topk, scoring_func="softmax")
    moe = SimpleNamespace(gate=gate, experts=experts)
    x = torch.randn(4, D, device=DEVICE)
    logits = torch.randn(4, E, device=DEVICE)
    logits[1, [2, 5, 9]] = 3.0  # a three-way tie for the top
    logits[2, [1, 7]] = 4.0
    logits[2, [3, 4]] = 2.0  # a tie across the K-th place: expert 3 is taken, 4 is not
    logits[3] = float("nan")
    ids, wts = route_softmax_topk(moe, logits)
    assert ids[1].tolist() == [2, 5, 9] and ids[2].tolist() == [1, 7, 3]
    with torch.no_grad():
        y = routed_experts(moe, x, logits)
        ref = fused_experts(experts, x[:3], ids[:3], wts[:3])
    torch.testing.assert_close(y[:3], ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("has_res", [False, True])
def test_normed_row_linear_equals_add_rmsnorm_then_projection(monkeypatch, dtype, has_res):
    """One launch of add + RMSNorm + up to three projections == `add_rmsnorm` then `project` (the normed row and
    the residual sum too), at D=40 (masked columns) and block rows of 4."""
    from torch import nn
    from moeloop.model.norm import RMSNorm
    from moeloop.rollout import fused_decode
    from moeloop.rollout.fused_decode import add_rmsnorm, normed_row_linear, project
    monkeypatch.setattr(fused_decode, "NORM_FOLD", True)
    torch.manual_seed(1)
    x = torch.randn(1, 40, device=DEVICE, dtype=dtype)
    res = torch.randn(1, 40, device=DEVICE, dtype=dtype) if has_res else None
    norm = RMSNorm(40, eps=1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(40) + 0.5)
    mods = [nn.Linear(40, n, bias=False).to(DEVICE, dtype) for n in (48, 16, 32)]
    assert fused_decode.norm_fold_applies(x, mods)
    with torch.no_grad():
        outs, y, res_out = normed_row_linear(x, res, norm, mods, want_y=True)
        ref_y, ref_res = add_rmsnorm(x, res, norm)
        ref_outs = project(ref_y, mods)
    tol = dict(rtol=0, atol=0) if DEVICE == "cpu" else dict(rtol=1.6e-2, atol=1e-5)  # GPU: the norm's sum order
    torch.testing.assert_close(y, ref_y, **tol)
    torch.testing.assert_close(res_out, ref_res, rtol=0, atol=0)
    for got, want in zip(outs, ref_outs):
        torch.testing.assert_close(got, want, **tol)
    (one,), none, _ = normed_row_linear(x, res, norm, mods[:1])
    assert none is None
    torch.testing.assert_close(one, ref_outs[0], **tol)
    if not has_res:  # the embedding fold: x is row ids[0] of a table, and that row is returned as the residual
        embed = nn.Embedding(9, 40).to(DEVICE, dtype)
        ids = torch.tensor([6], device=DEVICE)
        assert fused_decode.embed_fold_applies(embed, ids, mods)
        with torch.no_grad():
            embed.weight[6] = x[0]
            outs_e, y_e, res_e = normed_row_linear(embed.weight, None, norm, mods, want_y=True, ids_T=ids)
        assert torch.equal(res_e, x) and torch.equal(y_e, y)
        for got, want in zip(outs_e, outs):
            assert torch.equal(got, want)


def test_packed_qkv_projection_equals_three_and_follows_weight_changes():
    """With `derive_decode_weights` the fused forward runs q|k|v as one GEMM over a packed copy of the weights: the
    same outputs as three projections. The copy goes stale on an in-place weight change until `refresh()` sees the
    source's version counter move; a parameter that aliases another tensor (shared with a trainer) changes under that
    tensor's counter, so only `refresh(force=True)` (what `Engine.update_weights` calls) catches it."""
    from moeloop.rollout.decode_packs import derive_decode_weights
    model = tiny_model("qwen3_moe").to(DEVICE)
    cache = make_engine(model, enforce_eager=True).cache
    B, layers = 3, model.model.layers
    tables = torch.arange(B * 3, device=DEVICE, dtype=torch.int32).view(B, 3)
    slots = tables[:, 0].long() * cache.block_size + 4
    ids, pos = torch.randint(3, 256, (B,), device=DEVICE), torch.full((B,), 4, device=DEVICE)
    lens = torch.full((B,), 5, dtype=torch.int32, device=DEVICE)
    gemm_rows = []

    def logits(packs=None):
        saved = [layer.self_attn.__dict__.pop("_decode_qkv", None) for layer in layers]
        if packs is not None:
            for layer, pack in zip(layers, packs):
                layer.self_attn.__dict__["_decode_qkv"] = pack
        for layer in range(len(cache.k)):  # the same cached context for every call
            g = torch.Generator(device=DEVICE).manual_seed(layer)
            cache.k[layer].copy_(torch.randn(cache.k[layer].shape, generator=g, device=DEVICE))
            cache.v[layer].copy_(torch.randn(cache.v[layer].shape, generator=g, device=DEVICE))
        ctx = PagedAttention(cache, AttentionMetadata(slots, None, tables, lens, 5, []), use_kernel=False)
        real_linear = F.linear
        F.linear = lambda x, w, b=None: gemm_rows.append(w.shape[0]) or real_linear(x, w, b)
        try:
            with torch.no_grad():
                return model.compute_logits(fused_decode_forward(model, ids, pos, ctx))
        finally:
            F.linear = real_linear
            for layer, pack in zip(layers, saved):
                layer.self_attn.__dict__.pop("_decode_qkv", None)

    ref = logits()
    packs = derive_decode_weights(model)
    gemm_rows.clear()
    torch.testing.assert_close(logits(packs), ref, rtol=1e-5, atol=1e-5)
    attn = layers[0].self_attn
    qkv_rows = sum(m.weight.shape[0] for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert gemm_rows.count(qkv_rows) == len(layers)  # one packed GEMM per layer

    with torch.no_grad():
        attn.k_proj.weight.mul_(1.5)  # in place: the version counter moves
    live = logits()
    assert not torch.allclose(live, ref)
    torch.testing.assert_close(logits(packs), ref, rtol=1e-5, atol=1e-5)  # stale copy
    for p in packs:
        p.refresh()
    torch.testing.assert_close(logits(packs), live, rtol=1e-5, atol=1e-5)

    trainer_weight = attn.v_proj.weight.detach().clone()
    attn.v_proj.weight.data = trainer_weight  # as `share_parameters` aliases the trainer's tensor
    packs = derive_decode_weights(model)
    with torch.no_grad():
        trainer_weight.mul_(0.5)  # the trainer's counter moves, not the engine parameter's
    live = logits()
    for p in packs:
        p.refresh()
    assert not torch.allclose(logits(packs), live)  # not seen without force
    for p in packs:
        p.refresh(force=True)
    torch.testing.assert_close(logits(packs), live, rtol=1e-5, atol=1e-5)


def test_update_weights_refreshes_the_packed_copies(monkeypatch):
    model = tiny_model("qwen3_moe").to(DEVICE)
    engine = make_engine(model, enforce_eager=True)
    forced = []
    monkeypatch.setattr(engine.runner, "refresh_weights", lambda force=False: forced.append(force))
    engine.update_weights(model.state_dict().items())
    assert forced == [True]


@pytest.mark.parametrize("num_tokens,splits", [(5, 1), (16, 1), (37, 1), (37, 2), (16, 3), (37, 5)])
def test_router_topk_kernel_equals_projection_then_topk(monkeypatch, num_tokens, splits):
    """From ROUTER_FUSED_MIN_TOKENS tokens the router GEMM runs inside the top-k kernel (`_router_topk`); the
    same experts and weights as the module router (`Router._route_softmax` on F.linear logits). splits > 1: each
    token tile's columns over that many programs, summed by the last to finish (16 columns a step over the tiny
    model's 64: 3 splits take 32, 32 and none; 5 are capped at 4); twice, so the counters are seen back at 0."""
    import moeloop.rollout.fused_decode as fd
    monkeypatch.setattr(fd, "ROUTER_TOPK_SPLITS", splits)
    if splits > 1:
        monkeypatch.setattr(fd, "ROUTER_TOPK_TILE", (16, 16, 4, 2))
    model = tiny_model("qwen3_moe").to(DEVICE)
    moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate"))
    x = torch.randn(num_tokens, model.cfg.hidden_size, device=DEVICE)
    launches = []
    real = fd._router_topk
    fd._router_topk = type("Spy", (), {"__getitem__": lambda self, grid: launches.append(grid) or real[grid]})()
    try:
        with torch.no_grad():
            results = [fd.route(moe, x) for _ in range(2)]
            want = moe.gate(x)
    finally:
        fd._router_topk = real
    assert len(launches) == 2 * (num_tokens >= fd.ROUTER_FUSED_MIN_TOKENS)
    if launches:
        assert launches[0][1] == min(splits, -(-model.cfg.hidden_size // 16))
    for ids, wts in results:
        assert torch.equal(ids, want.ids_TK)
        torch.testing.assert_close(wts, want.weights_TK, rtol=1e-6, atol=1e-6)


def test_softmax_topk_keeps_expert_ids_in_range_on_a_nan_row():
    """A NaN logits row matches no maximum; its ids must still name real experts (the expert kernels read those
    experts' weights, before waiting, under PDL). Other rows: the top-k of the softmax, lowest id among ties."""
    from types import SimpleNamespace
    from moeloop.rollout.fused_decode import route_softmax_topk

    torch.manual_seed(0)
    E, K = 6, 2  # E padded to 8 inside the kernel
    gate = SimpleNamespace(top_k=K, routed_scaling_factor=1.0, norm_topk_prob=True)
    logits = torch.randn(3, E, device=DEVICE)
    logits[1] = float("nan")
    ids, wts = route_softmax_topk(SimpleNamespace(gate=gate), logits)
    assert ((ids >= 0) & (ids < E)).all()
    ref = logits[[0, 2]].softmax(-1).topk(K, dim=-1)
    assert ids[[0, 2]].tolist() == ref.indices.tolist()
    torch.testing.assert_close(wts[[0, 2]], ref.values / ref.values.sum(-1, keepdim=True))


@pytest.mark.skipif(DEVICE != "cuda", reason="programmatic dependent launch is a CUDA (Hopper) launch mode")
@pytest.mark.parametrize("batch", [1, 4, 8])
def test_pdl_launches_give_bitwise_the_same_decode(monkeypatch, batch):
    """The decode kernels launched with PDL (weights read before waiting on the previous kernel) and without: the
    same graphs' tokens and logprobs, bit for bit (a race would show here first)."""
    model = tiny_model("qwen3_moe").to(DEVICE, torch.bfloat16)
    ps = prompts(batch, seed=21)
    params = SamplingParams(n=1, temperature=1.0, max_tokens=24, seed=5)
    outs = {}
    for mode in ("on", "off"):
        monkeypatch.setenv("MOELOOP_PDL", mode)
        outs[mode] = make_engine(model).generate(ps, params)  # CUDA graphs captured under this mode
    assert [o.response_ids for o in outs["on"]] == [o.response_ids for o in outs["off"]]
    assert [o.logprobs for o in outs["on"]] == [o.logprobs for o in outs["off"]]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_composed_router_single_sequence_matches_module_path(monkeypatch, arch):
    """`ROUTER_COMPOSE`: B=1 decode runs o_proj, the residual add and the composed router in one launch
    (`o_proj_router`, every MoE layer every step); gate_up norms the residual row, down scales the logits; fp32:
    the same tokens and logprobs (1e-5) as the module forward."""
    from moeloop.rollout import decode_packs, fused_decode
    monkeypatch.setattr(decode_packs, "ROUTER_COMPOSE", True)
    calls, real = [], fused_decode.o_proj_router
    monkeypatch.setattr(fused_decode, "o_proj_router", lambda *a: calls.append(1) or real(*a))
    model = tiny_model(arch).to(DEVICE)
    packs = decode_packs.pack_routers(model)
    assert len(packs) == len(model.model.layers)
    assert_kernels_match_module_path(model, prompts(1, seed=5),
                                     SamplingParams(n=1, temperature=1.0, max_tokens=5, seed=2))
    assert len(calls) == 4 * len(model.model.layers)  # 4 decode steps after the prefill


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_qk_preload_single_sequence_matches_module_path(monkeypatch, arch):
    """`QK_PRELOAD`: the q/k norm launch of every layer after the first reads the position, slot and cos/sin row
    first (before its PDL wait on CUDA); fp32: the same tokens and logprobs (1e-5) as the module forward."""
    from moeloop.rollout import fused_decode
    monkeypatch.setattr(fused_decode, "QK_PRELOAD", True)
    early, real = [], fused_decode.qk_norm_rope_store
    monkeypatch.setattr(fused_decode, "qk_norm_rope_store", lambda *a, **k: early.append(k["early_pos"])
                        or real(*a, **k))
    model = tiny_model(arch).to(DEVICE)
    assert_kernels_match_module_path(model, prompts(2, seed=8),
                                     SamplingParams(n=1, temperature=1.0, max_tokens=5, seed=6))
    layers = len(model.model.layers)
    assert early == ([False] + [True] * (layers - 1)) * 4  # 4 decode steps after the prefill


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_o_proj_router_equals_module_path_and_follows_weight_changes(monkeypatch, dtype):
    """One `o_proj_router` launch: x = res + o_proj(o) as the module path rounds it, and the raw logits times
    1 / rms(x) equal the router's logits of RMSNorm(x) (fp32: 1e-5; bf16: within the module path's own rounding);
    the expert kernels on them equal the top-k routing through `fused_experts`. The composed weights follow an
    in-place change of o_proj (`refresh()`). The launch runs `O_PROJ_TILE` (2 o_proj rows, 2 warps: measured)."""
    from moeloop.rollout import decode_packs, fused_decode
    from moeloop.rollout.moe_kernel import fused_experts, routed_experts
    monkeypatch.setattr(decode_packs, "ROUTER_COMPOSE", True)
    tiles = recorded_grids(monkeypatch, fused_decode, ("_row_linear_router",),
                           lambda name, grid, kw: (grid, kw["BLOCK_N"], kw["num_warps"]))
    torch.manual_seed(7)
    model = tiny_model("qwen3_moe").to(DEVICE, dtype)
    layer = model.model.layers[1]
    with torch.no_grad():
        layer.post_attention_layernorm.weight.copy_(torch.rand_like(layer.post_attention_layernorm.weight) + 0.5)
    (pack,) = [p for p in decode_packs.pack_routers(model) if p.gate is layer.mlp.gate]
    A, D = layer.self_attn.o_proj.weight.shape[1], model.cfg.hidden_size
    o = torch.randn(1, A, device=DEVICE, dtype=dtype)
    res = torch.randn(1, D, device=DEVICE, dtype=dtype)
    assert fused_decode.composed_router(layer, o, res) is pack

    def reference():
        x = (res.float() + layer.self_attn.o_proj(o).float()).to(dtype)
        return x, layer.mlp.gate.weight.float() @ layer.post_attention_layernorm(x).float()[0]

    def check():
        with torch.no_grad():
            x, z = fused_decode.o_proj_router(o, res, pack)
            ref_x, ref_logits = reference()
        # bf16: the product's sum order (and, under the interpreter, its rounding mode) moves an element a step or two
        torch.testing.assert_close(x, ref_x, **(dict(rtol=0, atol=1e-5) if dtype == torch.float32
                                                else dict(rtol=2 ** -6, atol=2 ** -6)))
        rms = x.float().pow(2).mean().add(layer.post_attention_layernorm.eps).rsqrt()
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=0.05)
        torch.testing.assert_close(z[0] * rms, ref_logits, **tol)
        return x, z

    x, z = check()
    if dtype == torch.float32:  # the expert kernels' routing from the raw logits == the top-k path's
        ids, wts = fused_decode.route_softmax_topk(layer.mlp, (z * x.float().pow(2).mean().add(
            layer.post_attention_layernorm.eps).rsqrt()))
        with torch.no_grad():
            y = routed_experts(layer.mlp, x, z, layer.post_attention_layernorm)
            ref = fused_experts(layer.mlp.experts, layer.post_attention_layernorm(x), ids, wts)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        layer.self_attn.o_proj.weight.mul_(-1.5)
    stale = fused_decode.o_proj_router(o, res, pack)[1]
    pack.refresh()  # the version counter moved: recomputed
    _, fresh = check()
    assert not torch.allclose(stale, fresh)
    E = layer.mlp.gate.weight.shape[0]
    rows, warps = fused_decode.O_PROJ_TILE
    assert set(tiles) == {((D // rows + E,), rows, warps)}
    if "MOELOOP_O_PROJ_TILE" not in os.environ:  # (an A/B run sets another tile)
        assert (rows, warps) == (2, 2)


def test_update_weights_reaches_the_composed_router(monkeypatch):
    """An engine decoding B=1 through composed routers (`pack_routers`, refreshed with the packed weights) gets new
    o_proj, norm and router weights at `update_weights`: it then generates what a fresh engine on them does."""
    from moeloop.rollout import decode_packs
    monkeypatch.setattr(decode_packs, "ROUTER_COMPOSE", True)
    params = SamplingParams(n=1, temperature=1.0, max_tokens=5, seed=2)
    ps = prompts(1, seed=5)

    def engine_on(model):
        engine = make_engine(model, enforce_eager=True)
        engine.runner.use_kernel = True
        engine.runner.derived += decode_packs.pack_routers(model)
        return engine

    model = tiny_model("qwen3_moe").to(DEVICE)
    engine = engine_on(model)
    before = [o.response_ids for o in engine.generate(ps, params)]
    new = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    for k, v in new.items():
        if k.endswith(("o_proj.weight", "post_attention_layernorm.weight", "mlp.gate.weight")):
            v.add_(torch.randn(v.shape, generator=g).to(v), alpha=v.std().item() or 0.5)
    engine.update_weights(new.items(), version=1)
    after = engine.generate(ps, params)
    fresh = tiny_model("qwen3_moe").to(DEVICE)
    fresh.load_state_dict(new)
    want = engine_on(fresh).generate(ps, params)
    assert [o.response_ids for o in after] != before
    assert [o.response_ids for o in after] == [o.response_ids for o in want]
    for o, w in zip(after, want):
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
