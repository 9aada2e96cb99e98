"""The B=1 speculative expert prefetch (`rollout.expert_prefetch`, off by default): the speculative router rows,
their place in the packed q|k|v copy, the one-launch projection that computes them, and which chunks of which
experts each prefetch program covers (interpreter on CPU). The prefetch instruction itself runs only compiled on
sm_90 (`test_triton_sm90_compile.py` builds it); on a CUDA machine the last test checks that it changes no output."""
from types import SimpleNamespace

import pytest
import torch

from moeloop.model.norm import rmsnorm_reference
from moeloop.rollout import SamplingParams, expert_prefetch
from moeloop.rollout.decode_kernel import triton_available
from moeloop.rollout.expert_prefetch import spec_router_rows
from moeloop.rollout.fused_decode import QKVPack
from tests.test_rollout_engine import make_engine, prompts, tiny_model

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed (CPU torch wheel)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_spec_router_rows_give_the_router_logits_of_the_post_attention_norm():
    """spec rows . (w_in * n(x)) == router . (w_post * n(x)); a column whose input-norm weight is 0 is dropped."""
    torch.manual_seed(0)
    E, D = 8, 24
    router_w, x = torch.randn(E, D, dtype=torch.float64), torch.randn(3, D, dtype=torch.float64)
    w_in, w_post = torch.rand(D, dtype=torch.float64) + 0.5, torch.rand(D, dtype=torch.float64) + 0.5
    spec = spec_router_rows(router_w, w_in, w_post)
    torch.testing.assert_close(rmsnorm_reference(x, w_in, 1e-6) @ spec.T, rmsnorm_reference(x, w_post, 1e-6) @ router_w.T, rtol=1e-5, atol=1e-6)  # fp32
    w_in[5] = 0.0
    spec = spec_router_rows(router_w, w_in, w_post)
    assert torch.equal(spec[:, 5], torch.zeros(E, dtype=torch.float64)) and torch.isfinite(spec).all()


def test_packed_copy_holds_the_spec_rows_and_follows_router_and_norm_changes():
    model = tiny_model("qwen3_moe").to(DEVICE)
    layer = model.model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    pack = QKVPack(attn, (mlp.gate, layer.input_layernorm, layer.post_attention_layernorm))
    n = sum(pack.sizes)
    assert pack.weight.data_ptr() == pack.buffer.data_ptr() and pack.weight.shape[0] == n
    assert torch.equal(pack.weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))

    def expected():
        return spec_router_rows(mlp.gate.weight, layer.input_layernorm.weight, layer.post_attention_layernorm.weight)

    assert torch.equal(pack.buffer[n:], expected())
    for tensor in (mlp.gate.weight, layer.post_attention_layernorm.weight, layer.input_layernorm.weight):
        before = pack.buffer[n:].clone()
        with torch.no_grad():
            tensor.mul_(1.25)  # in place: the version counter moves
        pack.refresh()
        assert not torch.equal(pack.buffer[n:], before) and torch.equal(pack.buffer[n:], expected())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_projects_qkv_and_the_spec_rows(dtype):
    """`normed_row_linear` over the whole buffer: q|k|v bit for bit as over the three weights, and the spec logits
    as the spec rows' projection of the same normed row."""
    from moeloop.rollout.fused_decode import normed_row_linear, project
    model = tiny_model("qwen3_moe").to(DEVICE, dtype)
    layer = model.model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    pack = QKVPack(attn, (mlp.gate, layer.input_layernorm, layer.post_attention_layernorm))
    torch.manual_seed(2)
    x = torch.randn(1, model.cfg.hidden_size, device=DEVICE, dtype=dtype)
    res = torch.randn_like(x)
    with torch.no_grad():
        (packed,), y, res_out = normed_row_linear(x, res, layer.input_layernorm, [pack.spec_linear()], want_y=True)
        three, _, _ = normed_row_linear(x, res, layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj])
        (spec_ref,) = project(y, [SimpleNamespace(weight=pack.buffer[sum(pack.sizes):], bias=None)])
    *qkv, spec = packed.split(pack.sizes + [mlp.gate.weight.shape[0]], dim=1)
    for got, want in zip(qkv, three):
        assert torch.equal(got, want)
    tol = dict(rtol=0, atol=0) if DEVICE == "cpu" else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(spec, spec_ref, **tol)


if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _lanes_probe(spec_ptr, expert_ptr, chunk_ptr, ok_ptr, E: tl.constexpr, E_PAD: tl.constexpr, S: tl.constexpr,
                     CHUNKS: tl.constexpr, LANES: tl.constexpr):
        j = tl.program_id(0)
        expert, c, ok = expert_prefetch._prefetch_lanes(spec_ptr, j, E, E_PAD, S, CHUNKS, LANES)
        lane = j * LANES + tl.arange(0, LANES)
        tl.store(expert_ptr + lane, expert)
        tl.store(chunk_ptr + lane, c)
        tl.store(ok_ptr + lane, ok.to(tl.int32))


def _probe_lanes(spec: torch.Tensor, S: int, chunks: int, lanes: int, programs: int):
    E = spec.numel()
    out = [torch.full((programs * lanes,), -1, dtype=torch.int32, device=spec.device) for _ in range(3)]
    _lanes_probe[(programs,)](spec, *out, E=E, E_PAD=triton.next_power_of_2(E), S=S, CHUNKS=chunks, LANES=lanes)
    return [t.cpu() for t in out]


@pytest.mark.parametrize("E,S,chunks", [(64, 6, 24), (12, 4, 5), (64, 1, 32)])
def test_prefetch_programs_cover_the_top_ranked_experts_chunk_by_chunk(E, S, chunks):
    """Lane j * LANES + i of the prefetch programs owns chunk number j * LANES + i, rank-major over the S experts
    ranked first (logit descending, expert id ascending on ties): every chunk of those experts exactly once."""
    torch.manual_seed(E + S)
    spec = torch.randn(E, device=DEVICE).to(torch.bfloat16)
    spec[3] = spec[7 % E] = spec.max()  # a tie at the top: the lower id ranks first
    lanes = 32
    programs = triton.cdiv(S * chunks, lanes)
    expert, chunk, ok = _probe_lanes(spec, S, chunks, lanes, programs)
    order = sorted(range(E), key=lambda e: (-spec[e].float().item(), e))[:S]
    flat = torch.arange(programs * lanes)
    assert torch.equal(ok, (flat < S * chunks).int())
    used = ok.bool()
    want_expert = torch.tensor([order[f // chunks] for f in flat[used].tolist()], dtype=torch.int32)
    assert torch.equal(expert[used], want_expert) and torch.equal(chunk[used], (flat[used] % chunks).int())
    assert sorted(zip(expert[used].tolist(), chunk[used].tolist())) == [(e, c) for e in sorted(order)
                                                                         for c in range(chunks)]


def test_prefetch_lanes_stay_inside_the_weights_on_a_nan_row():
    spec = torch.full((16,), float("nan"), device=DEVICE)
    expert, _, ok = _probe_lanes(spec, 4, 8, 32, 1)
    assert ((expert >= 0) & (expert < 16)).all() and ok.sum() == 32


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="the bulk prefetch needs a CUDA device of compute capability 9 or more")
@pytest.mark.parametrize("down", [False, True])
def test_expert_prefetch_changes_no_token_or_logprob(monkeypatch, down):
    """B=1 decode with the prefetch programs (CUDA graphs and all) against without: the same tokens, the same
    logprobs (the prefetch only moves weights into L2)."""
    model = tiny_model("qwen3_moe").to("cuda", torch.bfloat16)
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=12, seed=3)
    ps = prompts(1, seed=5)
    ref = make_engine(model).generate(ps, params)
    monkeypatch.setattr(expert_prefetch, "EXPERT_PREFETCH", 3)
    monkeypatch.setattr(expert_prefetch, "EXPERT_PREFETCH_DOWN", down)
    monkeypatch.setattr(expert_prefetch, "PREFETCH_CHUNK", 256)  # the tiny model's experts: a few KB each
    calls = []
    launch = expert_prefetch.prefetch_launch
    monkeypatch.setattr(expert_prefetch, "prefetch_launch", lambda *a: calls.append(1) or launch(*a))
    engine = make_engine(model)
    assert all(p.spec is not None for p in engine.runner.qkv_packs)
    outs = engine.generate(ps, params)
    assert calls  # the prefetch launches ran
    assert [o.response_ids for o in outs] == [o.response_ids for o in ref]
    assert [o.logprobs for o in outs] == [o.logprobs for o in ref]
