"""Sampler: counter-based noise is batch-independent, top-k/top-p filter, logprobs are raw temperature-1."""
import pytest
import torch

from moeloop.rollout.sampler import (Sampler, SamplingTensors, _mix32, filter_logits, noise_at, ranked_topk, row_key,
                                     uniform_noise)
from moeloop.rollout.gumbel_kernel import topk_gumbel_argmax
from moeloop.rollout.topk_kernel import topk_sample
from tests.kernels import DEVICE, needs_kernels


def tensors(temps, keys, top_k=None, top_p=None, vocab=50):
    B = len(temps)
    return SamplingTensors(torch.tensor(temps, dtype=torch.float32),
                           torch.tensor(top_k or [vocab] * B), torch.tensor(top_p or [1.0] * B),
                           torch.tensor(keys, dtype=torch.int64), any_filter=top_k is not None or top_p is not None,
                           all_greedy=all(t == 0 for t in temps))


def test_noise_depends_only_on_row_key():
    keys = torch.tensor([row_key(s, c) for s, c in [(1, 0), (1, 1), (2, 0)]])
    u = uniform_noise(keys, 1000)
    assert torch.equal(u[1], uniform_noise(keys[1:2], 1000)[0])
    assert ((u > 0) & (u < 1)).all() and abs(u.mean().item() - 0.5) < 0.02
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])


def test_host_noise_equals_the_tensor_hash():
    """The CPU path hashes in numpy uint32; every device must draw the same noise as the int64 tensor version."""
    g = torch.Generator().manual_seed(0)
    keys = torch.tensor([row_key(s, c) for s in range(64) for c in (0, 7)] + [0, 0xFFFFFFFF])
    vocab = torch.cat([torch.arange(300), torch.randint(0, 2**31 - 1, (200,), generator=g)])[None, :]
    h = _mix32(_mix32(keys[:, None] ^ vocab) ^ keys[:, None])
    ref = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    got = noise_at(keys, vocab)
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    ids = torch.randint(0, 300, (keys.shape[0], 5), generator=g)
    assert torch.equal(noise_at(keys, ids), ref.gather(1, ids))


def test_sampling_distribution_matches_softmax():
    torch.manual_seed(0)
    logits = torch.randn(1, 6) * 1.5
    keys = [row_key(7, c) for c in range(20000)]
    st = tensors([0.7] * len(keys), keys, vocab=6)
    tokens, _ = Sampler()(logits.expand(len(keys), 6), st, want_logprobs=False)
    freq = torch.bincount(tokens, minlength=6).float() / len(keys)
    assert torch.allclose(freq, torch.softmax(logits[0] / 0.7, -1), atol=0.015)


def test_filter_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    out = filter_logits(logits, torch.tensor([2, 4]), torch.tensor([1.0, 0.7]))
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(out[1]).tolist() == [True, True, False, False]  # 0.5 < 0.7 needs the second
    out = filter_logits(logits, torch.tensor([4, 4]), torch.tensor([0.4, 0.81]))
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False]
    assert torch.isfinite(out[1]).tolist() == [True, True, True, False]


def test_logprobs_are_raw_temperature_one_and_greedy_is_argmax():
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    st = tensors([0.0, 0.5, 2.0], [row_key(s, 0) for s in range(3)], top_k=[50, 3, 50])
    tokens, logprobs = Sampler()(logits, st, want_logprobs=True)
    assert tokens[0] == logits[0].argmax()
    assert tokens[1] in logits[1].topk(3).indices
    ref = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    assert torch.equal(logprobs, ref)


@needs_kernels
def test_gumbel_kernel_equals_the_torch_draw():
    """The one-launch full-vocab draw (CUDA; here the Triton interpreter on CPU) picks the torch path's tokens: same
    hash, same noise, same logs and division, first index among equal maxima, the argmax on greedy rows; and
    returns the raw log-softmax of each token (up to fp32 summation order)."""
    from moeloop.rollout.gumbel_kernel import gumbel_sample
    device = DEVICE
    g = torch.Generator().manual_seed(0)
    B, V = 37, 3001  # V not a multiple of the kernel's block
    logits = (torch.randn(B, V, generator=g) * 3).to(device)
    logits[5, 100:110] = 50.0  # near-ties decided by the noise
    logits[3, 2500:2503] = 60.0  # a greedy row's equal maxima: the first
    temps = (torch.rand(B, generator=g) + 0.3).to(device)
    temps[3] = 0.0
    keys = torch.tensor([row_key(s, 7 * s) for s in range(B)], device=device)
    u = uniform_noise(keys, V)

    def reference() -> torch.Tensor:
        drawn = (logits / torch.where(temps > 0, temps, torch.ones_like(temps))[:, None]
                 - torch.log(-torch.log(u))).argmax(-1)
        return torch.where(temps > 0, drawn, logits.argmax(-1))

    def check(ref: torch.Tensor) -> None:
        tokens, lp = gumbel_sample(logits, keys, temps)
        assert torch.equal(tokens, ref) and tokens[3] == 2500
        want = torch.log_softmax(logits, -1).gather(1, ref[:, None])[:, 0]
        torch.testing.assert_close(lp, want, rtol=0, atol=2e-6)
    check(reference())
    import moeloop.rollout.gumbel_kernel as gumbel_kernel
    splits = gumbel_kernel.SPLITS
    try:
        for gumbel_kernel.SPLITS in (1, 3):  # one program per row; slices of 1024 ids and a short last one
            check(reference())
        logits[7, 1024:1030] = logits[7, 2048:2054] = 80.0  # near-ties in two later slices, decided by the noise
        ref = reference()
        check(ref)
        assert ref[7] >= 1024
    finally:
        gumbel_kernel.SPLITS = splits


@needs_kernels
@pytest.mark.parametrize("with_top_p", [False, True])
def test_topk_kernel_equals_the_torch_top_k_draw(monkeypatch, with_top_p):
    """The top-k path's one-kernel draw among the torch.topk candidates (CUDA; here the Triton interpreter) picks
    the torch path's tokens: per-row top-k (1 keeps only the max), top-p on some (peaked) rows, near-ties decided by the noise."""
    import moeloop.rollout.sampler as sampler
    device = DEVICE
    g = torch.Generator().manual_seed(1)
    B, V = 25, 3001  # (each top-k on 3+ rows; the interpreter's time grows with B)
    logits = (torch.randn(B, V, generator=g) * 0.5).to(device)  # flat: the noise decides among the candidates
    logits[4, 200:230] = 9.0  # 30 equal maxima: top-k 50 keeps them all
    temps = (torch.rand(B, generator=g) + 0.3)
    top_ks = torch.tensor([1, 2, 5, 17, 50, 64, 40] * 9)[:B]
    top_ps = torch.where(torch.arange(B) % 3 == 1, 0.6, 1.0) if with_top_p else torch.ones(B)
    logits[1::3] *= 12  # peaked rows: a 0.6 nucleus holds a few of the candidates
    keys = torch.tensor([row_key(s, 3 * s + 1) for s in range(B)])
    st = SamplingTensors(temps.to(device), top_ks.to(device), top_ps.to(device), keys.to(device), any_filter=True,
                         all_greedy=False, max_top_k=64, any_greedy=False, any_top_p=with_top_p)
    monkeypatch.setattr(sampler, "kernels_apply", lambda t: False)
    want = sampler._sample_top_k(logits, st)
    monkeypatch.setattr(sampler, "kernels_apply", lambda t: True)
    launched = []
    monkeypatch.setattr(sampler, "topk_gumbel_argmax", lambda *a: launched.append(1) or topk_gumbel_argmax(*a))
    got = sampler._sample_top_k(logits, st)
    assert launched and torch.equal(got, want)
    only_max = (top_ks == 1).to(device)
    assert torch.equal(got[only_max], logits.argmax(-1)[only_max]) and 200 <= got[4] < 230
    full = filter_logits(logits, st.top_ks_B, st.top_ps_B)  # the full-vocab filter keeps every drawn token
    assert torch.isfinite(full.gather(1, got[:, None])).all()


@needs_kernels
@pytest.mark.parametrize("case", ["top_k_same", "top_k_top_p", "full_vocab", "greedy_rows"])
def test_kernel_sampler_on_bf16_logits_equals_the_fp32_torch_path(monkeypatch, case):
    """With the kernels the sampler reads bf16 logits as they are (the decode's lm_head output: no fp32 copy; top-k,
    with or without top-p, in one fused launch): the same tokens and logprobs as the torch path on an fp32 copy."""
    import moeloop.rollout.sampler as sampler
    device = DEVICE
    g = torch.Generator().manual_seed(2)
    B, V = 40, 2500
    logits = (torch.randn(B, V, generator=g) * 2).to(torch.bfloat16).to(device)  # bf16: many equal values
    temps = torch.rand(B, generator=g) + 0.4
    if case == "greedy_rows":
        temps[::3] = 0.0
    top_ks = {"top_k_same": [50] * B, "top_k_top_p": [50, 7, 1, 33] * (B // 4)}.get(case, [V] * B)
    top_ps = [0.7, 1.0] * (B // 2) if case == "top_k_top_p" else [1.0] * B
    keys = torch.tensor([row_key(s, s + 11) for s in range(B)])
    st = SamplingTensors(temps.to(device), torch.tensor(top_ks, device=device), torch.tensor(top_ps, device=device),
                         keys.to(device), any_filter=case.startswith("top_k"), all_greedy=False,
                         max_top_k=max(top_ks), any_greedy=case == "greedy_rows",
                         any_top_p=case == "top_k_top_p")
    monkeypatch.setattr(sampler, "kernels_apply", lambda t: False)
    want_tokens, want_lp = Sampler()(logits.float(), st, want_logprobs=True)
    monkeypatch.setattr(sampler, "kernels_apply", lambda t: True)
    sorts, fused = [], []
    topk = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda t, k, dim=-1, sorted=True: sorts.append(sorted) or topk(t, k, dim, sorted=sorted))
    monkeypatch.setattr(sampler, "topk_sample", lambda *a: fused.append(1) or topk_sample(*a))
    tokens, lp = Sampler()(logits, st, want_logprobs=True)
    assert torch.equal(tokens, want_tokens) and lp.dtype == torch.float32
    assert not sorts  # no torch.topk anywhere
    assert bool(fused) == case.startswith("top_k")
    # a one-launch draw (`topk_sample`, `gumbel_sample`): its own log-softmax, another fp32 summation order
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=2e-6)


def test_ranked_topk_keeps_the_smallest_ids_among_ties():
    """Top-k is a total order, (logit descending, vocab id ascending): a k-th boundary inside a run of equal values
    keeps its smallest ids, in ranked_topk, filter_logits and the sampler's draws; -0.0 ties +0.0."""
    row = torch.tensor([[1.0, 3, 3, 2, 3, 3, 0, 5, -0.0, 0.0]])
    vals, ids = ranked_topk(row, 3)
    assert vals.tolist() == [[5.0, 3.0, 3.0]] and ids.tolist() == [[7, 1, 2]]
    assert ranked_topk(row, 10)[1].tolist() == [[7, 1, 2, 4, 5, 3, 0, 6, 8, 9]]
    assert ranked_topk(row.to(torch.bfloat16), 4)[1].tolist() == [[7, 1, 2, 4]]
    kept = torch.isfinite(filter_logits(row, torch.tensor([3]), torch.tensor([1.0])))[0]
    assert kept.nonzero()[:, 0].tolist() == [1, 2, 7]
    keys = [row_key(5, c) for c in range(400)]
    for max_top_k in (3, None):  # candidates, then the full-vocab filter: the same draws
        st = tensors([50.0] * len(keys), keys, top_k=[3] * len(keys), vocab=10)
        st.max_top_k = max_top_k
        tokens, _ = Sampler()(row.expand(len(keys), 10), st, want_logprobs=False)
        assert set(tokens.tolist()) == {1, 2, 7}
        if max_top_k is None:
            assert torch.equal(tokens, by_candidates)
        by_candidates = tokens


def test_top_k_paths_agree_on_tied_logits():
    """The candidate path (`ranked_topk`) and the full-vocab filter (`filter_logits`, a stable sort) keep the same
    tokens on bf16-valued rows with many ties at the k-th value: the same draws, greedy rows too."""
    g = torch.Generator().manual_seed(5)
    B, V = 18, 2500
    logits = _tied_logits(B, V, torch.bfloat16, g).float()
    top_ks = [1, 2, 5, 17, 50, 17, 50, 64, 3] * 2
    temps = [0.0, 0.7, 1.0, 1.5, 2.0, 1.0] * 3
    st = tensors(temps, [row_key(s, 9) for s in range(B)], top_k=top_ks, vocab=V)
    by_candidates, _ = Sampler()(logits, SamplingTensors(**{**vars(st), "max_top_k": 64}), want_logprobs=False)
    by_filter, _ = Sampler()(logits, st, want_logprobs=False)  # max_top_k None: filter_logits over the full vocab
    assert torch.equal(by_candidates, by_filter)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ranked_candidates_kernel_equals_ranked_topk(monkeypatch, dtype):
    """`ranked_candidates` (the kernels' ranked_topk: slices' local top-n, then the row's last program ranks them)
    returns the torch path's values and ids in the same order, on rows with runs of ties across slice borders,
    for n from 1 to 256."""
    import moeloop.rollout.sampler as sampler
    from moeloop.rollout.topk_kernel import ranked_candidates
    g = torch.Generator().manual_seed(6)
    logits = _tied_logits(9, 2500, dtype, g).to(DEVICE)
    logits[0, 7] = -0.0  # equal to +0.0 in the order
    for n in (1, 17, 50, 64, 256):
        monkeypatch.setattr(sampler, "kernels_apply", lambda t: False)
        want_vals, want_ids = ranked_topk(logits, n)
        monkeypatch.setattr(sampler, "kernels_apply", lambda t: True)
        vals, ids = ranked_candidates(logits, n)
        assert vals.dtype == logits.dtype and torch.equal(ids, want_ids) and torch.equal(vals, want_vals), n


def _spy_plans(monkeypatch, groups: bool, poison: bool = False) -> list:
    """Set `TOPK_GROUPS`; return the list that collects each `topk_sample` launch's `_SlicePlan`. poison: its
    candidate slots start as NaN and id -1 (what a slot that phase 1 leaves unwritten holds then)."""
    from moeloop.rollout import topk_kernel
    monkeypatch.setattr(topk_kernel, "TOPK_GROUPS", groups)
    plans, plan_cls = [], topk_kernel._SlicePlan

    def recorded_plan(*args, **kwargs):
        plans.append(plan_cls(*args, **kwargs))
        if poison:
            plans[-1].cand_z_BSC.fill_(float("nan"))
            plans[-1].cand_v_BSC.fill_(-1)
        return plans[-1]

    monkeypatch.setattr(topk_kernel, "_SlicePlan", recorded_plan)
    return plans


def _assert_both_phase_one_paths(plan, top_ks: torch.Tensor, groups: bool) -> None:
    """With groups, some slices kept more than their row's top-k (the superset); row 6's first two slices (156 and
    144 tokens tied at its maximum, past the 128 slots) kept exactly its top-k 50 (the exact fallback). Without,
    every slice kept exactly k (each holds more than 64 tokens)."""
    cnt = plan.cnt_BS.cpu()
    k = top_ks.clamp(1, 64)[:, None].expand_as(cnt)
    assert bool((cnt > k).any()) == groups and not bool((cnt < k).any())
    if groups:
        assert plan.groups == 128 and plan.C == 128 and cnt[6, :2].tolist() == [50, 50]


def _tied_logits(B: int, V: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """randn * 2 rows (in bf16: many equal values) with runs of equal values across the fused kernel's slices."""
    logits = (torch.randn(B, V, generator=g) * 2).to(dtype)
    logits[4, 200:230] = 9.0  # 30 equal maxima: top-k 50 keeps them all, smaller top-ks the smallest ids
    logits[5, :10] = 9.0  # ... a top-17 boundary inside a run that crosses a slice border (256)
    logits[5, 250:262] = 8.0
    logits[6, 100:400] = 8.0  # top-50 inside 300 equal maxima over two borders
    return logits


@needs_kernels
@pytest.mark.parametrize("dtype,short,groups", [(torch.bfloat16, False, False), (torch.float32, False, False),
                                                (torch.bfloat16, True, False), (torch.float32, True, False),
                                                (torch.bfloat16, True, True), (torch.float32, True, True)])
def test_fused_top_p_kernel_equals_the_torch_path(monkeypatch, dtype, short, groups):
    """`topk_sample` with top-p (phase 2 weighs the mass ahead of each top-k token in fp64) picks the torch path's
    tokens: `ranked_topk` candidates, `nucleus_drop`, the Gumbel draw. Rows: ties at the top, a few dominant tokens
    (a small nucleus), flat rows (the top-k limits first), top_p 1 beside top_p < 1, greedy rows, top-k 1. short:
    `TOPK_SHORT`'s bisections (early stop, phase 2 from the full slices' bound). groups: `TOPK_GROUPS` (phase 1
    keeps the group bound's superset; the tied rows 4-6 and 10 send some slices to the exact fallback)."""
    import moeloop.rollout.sampler as sampler
    from moeloop.rollout import topk_kernel
    monkeypatch.setattr(topk_kernel, "TOPK_SHORT", short)
    plans = _spy_plans(monkeypatch, groups)
    g = torch.Generator().manual_seed(6)
    B, V = 18, 2500
    logits = _tied_logits(B, V, dtype, g).to(DEVICE)
    logits[9, [17, 900, 1500]] = 12.0  # three dominant tokens: a 0.5 nucleus keeps two of them (ties: smallest ids)
    logits[10] = (torch.arange(V, device=DEVICE) % 97).to(dtype) * 0.05  # 26 tokens tie at each value: a 0.05
    # nucleus keeps the 26 at the top and the first (smallest id) of the next 26, inside the top-64
    temps = torch.rand(B, generator=g) + 0.3
    temps[[2, 11]] = 0.0
    top_ks = torch.tensor([1, 2, 5, 17, 50, 17, 50, 64, V, 50, 64, 17, 50, 64, 1, 2, 5, 50])
    top_ps = torch.tensor([0.9, 0.5, 0.3, 1.0, 0.8, 0.95, 0.6, 0.99, 0.7, 0.5, 0.05, 0.9, 1.0, 0.2, 0.5, 0.9, 0.75,
                           0.05])
    keys = torch.tensor([row_key(s, 7 * s + 3) for s in range(B)])
    st = SamplingTensors(temps.to(DEVICE), top_ks.to(DEVICE), top_ps.to(DEVICE), keys.to(DEVICE), any_filter=True,
                         all_greedy=False, max_top_k=64, any_greedy=True, any_top_p=True)
    monkeypatch.setattr(sampler, "kernels_apply", lambda t: False)
    want_tokens, want_lp = Sampler()(logits.float(), st, want_logprobs=True)
    tokens, lp = topk_sample(logits, st.keys_B, st.temperatures_B, st.top_ks_B, 64, st.top_ps_B)
    assert torch.equal(tokens, want_tokens) and lp.dtype == torch.float32
    _assert_both_phase_one_paths(plans[0], top_ks, groups)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=2e-6)
    greedy = temps == 0
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    full = filter_logits(logits.float(), st.top_ks_B, st.top_ps_B)  # the full-vocab filter keeps every drawn token
    assert torch.isfinite(full.gather(1, tokens[:, None])).all()
    assert tokens[9] in (17, 900)  # the third equal maximum lies outside a 0.5 nucleus
    top = logits[10] == logits[10].max()
    assert top[tokens[10]] or tokens[10] == 95  # the first id at the second value (4.75)


@needs_kernels
@pytest.mark.parametrize("dtype,short,groups,all_slots", [
    (torch.bfloat16, False, False, False), (torch.float32, False, False, False), (torch.bfloat16, True, False, False),
    (torch.float32, True, False, False), (torch.bfloat16, True, True, False), (torch.float32, True, True, False),
    (torch.bfloat16, True, True, True), (torch.float32, True, True, True)])
def test_fused_topk_kernel_equals_the_torch_path(monkeypatch, dtype, short, groups, all_slots):
    """`topk_sample` (one launch: slice candidates, then the row's last program draws; here the Triton interpreter)
    picks the torch path's tokens bit for bit, greedy rows too, and its logprobs are torch.log_softmax's within 2e-6
    (another fp32 summation order). A row's draw does not depend on the rows beside it. short: as in the top-p
    test. all_slots (`TOPK_READS_EARLY`): phase 2 reads every slot, the unused ones poisoned (NaN, id -1)."""
    import moeloop.rollout.sampler as sampler
    from moeloop.rollout import topk_kernel
    monkeypatch.setattr(topk_kernel, "TOPK_SHORT", short)
    monkeypatch.setattr(topk_kernel, "TOPK_READS_EARLY", all_slots)
    plans = _spy_plans(monkeypatch, groups, poison=all_slots)
    g = torch.Generator().manual_seed(4)
    B, V = 18, 2500  # slices of 256 ids: 10 programs per row
    logits = _tied_logits(B, V, dtype, g).to(DEVICE)
    temps = torch.rand(B, generator=g) + 0.3
    temps[[2, 7, 11]] = 0.0
    top_ks = torch.tensor([1, 2, 5, 17, 50, 17, 50, 64, V, 2, 5, 17, 50, 64, 1, 2, 5, 50])  # V: clamped to 64
    keys = torch.tensor([row_key(s, 5 * s + 2) for s in range(B)])
    st = SamplingTensors(temps.to(DEVICE), top_ks.to(DEVICE), torch.ones(B, device=DEVICE), keys.to(DEVICE),
                         any_filter=True, all_greedy=False, max_top_k=64, any_greedy=True, any_top_p=False)
    monkeypatch.setattr(sampler, "kernels_apply", lambda t: False)
    want_tokens, want_lp = Sampler()(logits.float(), st, want_logprobs=True)
    tokens, lp = topk_sample(logits, st.keys_B, st.temperatures_B, st.top_ks_B, 64)
    assert torch.equal(tokens, want_tokens) and lp.dtype == torch.float32
    _assert_both_phase_one_paths(plans[0], top_ks, groups)
    torch.testing.assert_close(lp, want_lp, rtol=0, atol=2e-6)
    assert 200 <= tokens[4] < 230 and (tokens[5] < 10 or 250 <= tokens[5] < 257) and 100 <= tokens[6] < 150
    greedy = temps == 0
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    rows = [5, 6, 2]
    sub = topk_sample(logits[rows], st.keys_B[rows], st.temperatures_B[rows], st.top_ks_B[rows], 64)
    assert torch.equal(sub[0], tokens[rows])


@needs_kernels
def test_row_counters_are_reused_and_left_at_zero():
    """On CUDA the one-launch samplers share one int32 counter per row across launches (no memset before each):
    every launch's last program per row sets it back to 0, so repeated launches draw the same tokens as the
    first. Elsewhere each launch gets fresh zeros."""
    from moeloop.rollout.gumbel_kernel import gumbel_sample, row_counters
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 5000, generator=g).to(DEVICE)
    keys = torch.tensor([row_key(7, s) for s in range(3)], device=DEVICE)
    temps, top_ks = torch.ones(3, device=DEVICE), torch.tensor([1, 20, 50], device=DEVICE)
    first = [topk_sample(logits, keys, temps, top_ks, 50), gumbel_sample(logits, keys, temps)]
    for _ in range(3):
        again = [topk_sample(logits, keys, temps, top_ks, 50), gumbel_sample(logits, keys, temps)]
        for (tok, lp), (tok0, lp0) in zip(again, first):
            assert torch.equal(tok, tok0) and torch.equal(lp, lp0)
    counters = row_counters(logits.device, 3)
    assert (counters is row_counters(logits.device, 3)) == (logits.device.type == "cuda")
    assert not counters.any()


@needs_kernels
@pytest.mark.parametrize("draw,advance,want_logprobs", [(d, a, a) for d in ("top_k", "top_k_top_p", "no_filter")
                                                        for a in (True, False)] + [("top_k", True, False)])
def test_one_launch_draw_writes_the_multistep_record(draw, advance, want_logprobs):
    """With a `StepRecord` the one-launch samplers (multi-step decode's draw) also write the step's tokens and
    logprobs into the output rows and advance the next step's inputs, exactly as `record_and_advance`'s torch ops
    do after a draw without one; the record is marked written and the draw itself is unchanged."""
    from moeloop.rollout.gumbel_kernel import StepRecord, gumbel_sample
    from moeloop.rollout.multistep import record_and_advance
    g = torch.Generator().manual_seed(9)
    B, V, K, k, block = 5, 1500, 4, 2, 4
    logits = torch.randn(B, V, generator=g).to(DEVICE)
    keys = torch.tensor([row_key(3, s) for s in range(B)], device=DEVICE)
    temps = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0], device=DEVICE)
    top_ks, top_ps = torch.tensor([50, 5, 50, 1, 20], device=DEVICE), torch.tensor([0.9, 1.0, 0.5, 1.0, 0.3],
                                                                                   device=DEVICE)

    def draw_with(record):
        if draw == "no_filter":
            return gumbel_sample(logits, keys, temps, record=record)
        return topk_sample(logits, keys, temps, top_ks, 50, top_ps if draw == "top_k_top_p" else None, record=record)

    def state():
        pos = torch.tensor([3, 7, 8, 15, 0], device=DEVICE)
        tables = torch.randint(0, 90, (B, 6), generator=g).to(DEVICE)
        out = torch.full(((2 if want_logprobs else 1) * K, B), -1.0, dtype=torch.float64, device=DEVICE)
        return out, (torch.zeros(B, dtype=torch.int64, device=DEVICE), pos, torch.zeros_like(pos), pos + 1, tables,
                     block)

    g.manual_seed(1)
    out_ref, inputs_ref = state()
    tokens, lp = draw_with(None)
    record_and_advance(tokens, lp if want_logprobs else None, out_ref, k, K, inputs_ref if advance else None)
    g.manual_seed(1)
    out, inputs = state()
    record = StepRecord(out, k, K, inputs if advance else None)
    tokens2, lp2 = draw_with(record)
    assert record.written and torch.equal(tokens2, tokens) and torch.equal(lp2, lp)
    assert torch.equal(out, out_ref) and (out[k] >= 0).all()
    for got, want in zip(inputs[:5], inputs_ref[:5]):
        assert torch.equal(got, want)
    assert advance == bool((inputs[0] == tokens).all() and (inputs[1] != torch.tensor([3, 7, 8, 15, 0], device=DEVICE)).all())


@needs_kernels
def test_group_bound_applies_only_where_it_was_measured(monkeypatch):
    """`TOPK_GROUPS` takes the group bound for `topk_sample` with top-k up to 64 when phase 2 has at most 2048
    candidate slots (V=32000: 16 slices x 128); a 152k vocabulary (64 slices), a larger top-k and
    `ranked_candidates` keep the exact per-slice top-k."""
    from moeloop.rollout import topk_kernel
    monkeypatch.setattr(topk_kernel, "TOPK_GROUPS", True)

    def plan(V: int, k: int, superset: bool = True):
        return topk_kernel._SlicePlan(torch.empty(1, V), k, superset=superset)

    assert (plan(32000, 50).groups, plan(32000, 50).C, plan(32000, 50).k_pad) == (128, 128, 64)
    assert (plan(151936, 50).groups, plan(151936, 50).C) == (0, 64)
    assert (plan(32000, 100).groups, plan(32000, 50, superset=False).groups) == (0, 0)
    monkeypatch.setattr(topk_kernel, "TOPK_GROUPS", False)
    assert (plan(32000, 50).groups, plan(32000, 50).C) == (0, 64)
