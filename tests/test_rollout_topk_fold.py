"""The top-k fold (`moe_kernel.fused_experts_from_logits`): the few-token expert kernels route each token themselves
from its router logits. Their routing (`_softmax_topk_row`) gives `_softmax_topk`'s ids and weights bit for bit, so
the expert output is exactly that of `route_softmax_topk` + `fused_experts`: ties (lowest expert id), a NaN row
(expert 0), renormalisation on and off, a scaling factor, padded E and K. On CPU under the Triton interpreter."""
import pytest
import torch

from moeloop.model.config import ModelConfig
from moeloop.model.kernel_switch import triton, triton_interpreting
from moeloop.model.moe import MoE
from tests.kernels import DEVICE, needs_kernels

pytestmark = [needs_kernels,  # (numpy, under the interpreter, on the NaN and -inf rows)
              pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

if triton is not None:
    import triton.language as tl

    from moeloop.rollout.moe_kernel import _lane_order_sum, _softmax_topk_row

    @triton.jit
    def _route_rows(logits_ptr, ids_ptr, wts_ptr, scale, E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr,
                    K_PAD: tl.constexpr, NORM: tl.constexpr, LANE_SUM: tl.constexpr):
        """Program t: what `_softmax_topk_row` gives token t, stored as ids / weights [T, K]."""
        t = tl.program_id(0)
        ids, wts = _softmax_topk_row(logits_ptr, t, scale, E, E_PAD, K, K_PAD, NORM, LANE_SUM)
        k = tl.arange(0, K_PAD)
        tl.store(ids_ptr + t * K + k, ids, mask=k < K)
        tl.store(wts_ptr + t * K + k, wts, mask=k < K)

    @triton.jit
    def _lane_sums(x_ptr, out_ptr, N: tl.constexpr):
        i = tl.program_id(0)
        tl.store(out_ptr + i, _lane_order_sum(tl.load(x_ptr + i * N + tl.arange(0, N)), N))

D, F = 32, 16
SCALE = 2.5  # routed_scaling_factor


def make_moe(E: int, K: int, norm: bool, dtype: torch.dtype, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    cfg = ModelConfig(model_type="qwen3_moe", vocab_size=256, hidden_size=D, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=0, num_experts=E, num_experts_per_tok=K,
                      moe_intermediate_size=F, norm_topk_prob=norm, routed_scaling_factor=SCALE)
    moe = MoE(cfg).to(DEVICE, dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
    return moe


def logits_rows(E: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[8, E]: plain random rows, rows with many exact ties (also across the top-k boundary), all equal, all but one
    expert at -inf (the rest of the top k ties at probability 0), and a NaN row."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randn(E, generator=g) * 2,
            torch.randint(-2, 3, (E,), generator=g) * 0.5,
            torch.zeros(E),
            torch.randn(E, generator=g) * 3,
            torch.randint(0, 2, (E,), generator=g).float(),
            torch.full((E,), float("-inf")).index_fill(0, torch.tensor([E // 2]), 1.0),
            torch.full((E,), float("nan")),
            torch.randn(E, generator=g) * 0.01]
    return torch.stack(rows).to(DEVICE, dtype)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal, NaN where the other is NaN."""
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(a.masked_fill(a.isnan(), 0), b.masked_fill(b.isnan(), 0))


def helper_routing(moe: MoE, logits: torch.Tensor, num_warps: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = logits.shape
    K = moe.gate.top_k
    ids = torch.empty(T, K, dtype=torch.int64, device=logits.device)
    wts = torch.empty(T, K, dtype=torch.float32, device=logits.device)
    _route_rows[(T,)](logits, ids, wts, float(moe.gate.routed_scaling_factor), E=E, E_PAD=triton.next_power_of_2(E),
                      K=K, K_PAD=triton.next_power_of_2(K), NORM=bool(moe.gate.norm_topk_prob),
                      LANE_SUM=not triton_interpreting(), num_warps=num_warps)
    return ids, wts


@pytest.mark.parametrize("E,K", [(8, 2), (64, 4), (6, 3)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_helper_routing_equals_softmax_topk_kernel(E, K, norm, dtype):
    from moeloop.rollout.fused_decode import route_softmax_topk
    moe = make_moe(E, K, norm, dtype)
    for seed in range(3):
        logits = logits_rows(E, dtype, seed)
        want_ids, want_wts = route_softmax_topk(moe, logits)
        for num_warps in (1, 4, 8):  # (on a GPU: other layouts, the same bits)
            ids, wts = helper_routing(moe, logits, num_warps)
            assert torch.equal(ids, want_ids)
            assert_same_bits(wts, want_wts)
    assert want_ids[2].tolist() == list(range(K))  # all tied: the lowest ids
    assert want_ids[6].tolist() == [0] * K and want_wts[6, 0].isnan()  # the NaN row: expert 0


@pytest.mark.parametrize("T,E,K", [(1, 64, 4), (2, 64, 4), (4, 64, 4), (1, 6, 3), (4, 8, 2)])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_experts_from_logits_equals_topk_then_experts(T, E, K, norm, dtype):
    from moeloop.rollout.fused_decode import route_softmax_topk
    from moeloop.rollout.moe_kernel import fused_experts, fused_experts_from_logits, topk_fold_applies
    moe = make_moe(E, K, norm, dtype, seed=T)
    logits = logits_rows(E, dtype, seed=T)[[0, 1, 5, 6]]  # random, ties, ties at probability 0, NaN
    x = torch.randn(logits.shape[0], D, generator=torch.Generator().manual_seed(T)).to(DEVICE, dtype)
    with torch.no_grad():
        for start in range(0, logits.shape[0], T):  # each kind of row, T tokens a launch
            x_TD, logits_TE = x[start:start + T], logits[start:start + T]
            assert topk_fold_applies(x_TD, logits_TE, moe.gate)
            want = fused_experts(moe.experts, x_TD, *route_softmax_topk(moe, logits_TE))
            got = fused_experts_from_logits(moe.experts, x_TD, logits_TE, moe.gate)
            assert_same_bits(got, want)
            finite = ~logits_TE.isnan().any(1)
            assert want[finite].isfinite().all() and (want[finite] != 0).any(1).all()


def test_lane_order_sum_adds_in_the_one_warp_order():
    """`_lane_order_sum` adds x[l], x[l + 32], ... per lane, then halves the lanes (16, 8, ..., 1): the order differs
    from a left-to-right sum often enough to tell on these values, and is matched bit for bit."""
    torch.manual_seed(0)
    for N in (4, 16, 32, 64, 128):
        x = torch.rand(64, N, device=DEVICE) * torch.logspace(-6, 0, N, device=DEVICE)[torch.randperm(N)]
        out = torch.empty(64, device=DEVICE)
        _lane_sums[(64,)](x, out, N=N)
        lanes = x[:, :min(N, 32)].clone()
        for c in range(1, N // 32):
            lanes = lanes + x[:, 32 * c:32 * (c + 1)]
        while lanes.shape[1] > 1:
            half = lanes.shape[1] // 2
            lanes = lanes[:, :half] + lanes[:, half:]
        assert torch.equal(out, lanes[:, 0])
        seq = x[:, 0].clone()
        for i in range(1, N):
            seq = seq + x[:, i]
        if N >= 32:
            assert not torch.equal(out, seq)


def test_topk_fold_applies_only_to_few_tokens_of_a_softmax_router():
    from moeloop.rollout.moe_kernel import FUSED_MAX_ASSIGNMENTS, topk_fold_applies
    moe = make_moe(8, 2, True, torch.float32)
    T = FUSED_MAX_ASSIGNMENTS // 2
    assert topk_fold_applies(torch.zeros(T, D, device=DEVICE), torch.zeros(T, 8, device=DEVICE), moe.gate)
    assert not topk_fold_applies(torch.zeros(T + 1, D, device=DEVICE), torch.zeros(T + 1, 8, device=DEVICE), moe.gate)
    assert not topk_fold_applies(torch.zeros(1, D, device=DEVICE), torch.zeros(2, 8, device=DEVICE), moe.gate)
    moe.gate.scoring_func = "sigmoid"
    assert not topk_fold_applies(torch.zeros(1, D, device=DEVICE), torch.zeros(1, 8, device=DEVICE), moe.gate)
