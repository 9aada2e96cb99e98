"""Packing alignment (hand example), token-budget micro-batches and DP partition (hypothesis)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from moeloop.train.packing import global_loss_denominators, pack_samples, split_micro_batches, unpack_response_values
from moeloop.train.partition import partition_for_dp
from moeloop.types import Sample


def hand_samples() -> list[Sample]:
    return [
        Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], old_logprobs=[-0.1, -0.2, -0.3], advantages=[1.0, 1.0, 1.0]),
        Sample(prompt_ids=[6], response_ids=[7], old_logprobs=[-0.7], advantages=[9.0], reward_status="masked"),
        Sample(prompt_ids=[8, 9], response_ids=[], old_logprobs=[], advantages=[]),
        Sample(prompt_ids=[10], response_ids=[11, 12], old_logprobs=[-1.1, -1.2], advantages=[-2.0, -2.0], loss_mask=[1, 0]),
    ]


def test_pack_alignment_by_hand():
    b = pack_samples(hand_samples())
    assert b.input_ids_T.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    assert b.position_ids_T.tolist() == [0, 1, 2, 3, 4, 0, 1, 0, 1, 0, 1, 2]
    assert b.labels_T.tolist() == [2, 3, 4, 5, 0, 7, 0, 9, 0, 11, 12, 0]
    assert b.cu_seqlens.tolist() == [0, 5, 7, 9, 12] and b.cu_seqlens.dtype == torch.int32
    assert b.max_seqlen == 5
    # position o+P-1+j predicts response token j; masked sample and loss_mask=0 tokens are out
    assert b.loss_mask_T.tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0]
    assert b.old_logprobs_T.tolist() == pytest.approx([0, -0.1, -0.2, -0.3, 0, -0.7, 0, 0, 0, -1.1, -1.2, 0])
    assert b.advantages_T.tolist() == [0, 1, 1, 1, 0, 9, 0, 0, 0, -2, -2, 0]
    assert b.ref_logprobs_T is None and b.returns_T is None
    back = unpack_response_values(b, b.old_logprobs_T)
    assert [x.tolist() for x in back] == [pytest.approx([-0.1, -0.2, -0.3]), pytest.approx([-0.7]), [], pytest.approx([-1.1, -1.2])]


def test_token_stream_by_hand():
    samples = [Sample(prompt_ids=[1, 2], response_ids=[3]), Sample(prompt_ids=[5], response_ids=[6, 7]),
               Sample(prompt_ids=[1, 2], response_ids=[4, 9]), Sample(prompt_ids=[8], response_ids=[])]
    b = pack_samples(samples)  # packed: [1 2 3][5 6 7][1 2 4 9][8]
    st = b.stream  # rows: prompt [1 2] once, [5], [8]; responses without their last token: [6], [4]
    assert st.input_ids_U.tolist() == [1, 2, 5, 6, 4, 8]
    assert st.position_ids_U.tolist() == [0, 1, 0, 1, 2, 0]
    assert st.owner_U.tolist() == [0, 1, 3, 4, 8, 10]
    # a last response token (packed 2, 5, 9) reads its predecessor's row: it predicts nothing, no query sees it
    assert st.gather_T.tolist() == [0, 1, 1, 2, 3, 3, 0, 1, 4, 4, 5]
    needed = b.loss_mask_T.bool() | (b.labels_T != 0)  # every position predicting a token
    assert torch.equal(st.input_ids_U[st.gather_T][needed], b.input_ids_T[needed])
    assert torch.equal(st.position_ids_U[st.gather_T][needed], b.position_ids_T[needed])
    assert pack_samples(samples, compact=False).stream is None
    assert pack_samples([Sample(prompt_ids=[1, 2], response_ids=[])]).stream is None  # nothing to save


def test_pack_errors():
    with pytest.raises(ValueError, match="empty prompt"):
        pack_samples([Sample(prompt_ids=[], response_ids=[1])])
    with pytest.raises(ValueError, match="old_logprobs has 1 values for 2"):
        pack_samples([Sample(prompt_ids=[1], response_ids=[1, 2], old_logprobs=[0.0])])
    with pytest.raises(ValueError, match="sample 1 has no advantages"):
        pack_samples([Sample(prompt_ids=[1], response_ids=[2], advantages=[1.0]), Sample(prompt_ids=[1], response_ids=[2])])


def test_global_loss_denominators_by_hand():
    s = hand_samples()  # loss tokens: 3 + 0 (masked) + 0 (empty) + 1 = 4, in 2 sequences
    assert global_loss_denominators(s, "token-mean") == 4
    assert global_loss_denominators(s, "seq-mean-token-sum") == 2
    assert global_loss_denominators(s, "seq-mean-token-mean") == 2
    assert global_loss_denominators(s, "seq-mean-token-sum-norm", max_response_length=8) == 16


def test_oversized_sample_raises():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=4"):
        split_micro_batches([Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5])], 4)


def samples_of(lengths: list[tuple[int, int]]) -> list[Sample]:
    return [Sample(prompt_ids=[7] * p, response_ids=[8] * r) for p, r in lengths]


LENGTHS = st.lists(st.tuples(st.integers(1, 20), st.integers(0, 20)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(lengths=LENGTHS, budget=st.integers(40, 100), min_num=st.integers(1, 4))
def test_micro_batches_cover_once_and_respect_budget(lengths, budget, min_num):
    samples = samples_of(lengths)
    min_num = min(min_num, len(samples))
    cuts = split_micro_batches(samples, budget, min_num)
    flat = [i for cut in cuts for i in cut]
    assert sorted(flat) == list(range(len(samples)))  # every sample (so every token) exactly once
    assert len(cuts) >= min_num and all(cuts)
    for cut in cuts:
        packed = pack_samples([samples[i] for i in cut])
        assert packed.num_tokens <= budget
    assert cuts == split_micro_batches(samples, budget, min_num)  # deterministic


@settings(max_examples=60, deadline=None)
@given(lengths=LENGTHS)
def test_pack_labels_at_loss_positions_are_response_tokens(lengths):
    samples = [Sample(prompt_ids=list(range(100, 100 + p)), response_ids=list(range(200, 200 + r))) for p, r in lengths]
    b = pack_samples(samples)
    assert b.num_tokens == sum(p + r for p, r in lengths)
    on = b.loss_mask_T.bool()
    assert b.labels_T[on].tolist() == [t for s in samples for t in s.response_ids]
    assert int(on.sum()) == global_loss_denominators(samples, "token-mean")


@settings(max_examples=60, deadline=None)
@given(lengths=LENGTHS, dp=st.integers(1, 8))
def test_partition_balanced_within_max_item(lengths, dp):
    samples = samples_of(lengths)
    if len(samples) < dp:
        with pytest.raises(ValueError, match="dp_size"):
            partition_for_dp(samples, dp)
        return
    parts = partition_for_dp(samples, dp)
    assert len(parts) == dp and all(parts)
    assert sorted(i for p in parts for i in p) == list(range(len(samples)))
    loads = [sum(samples[i].num_tokens for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(s.num_tokens for s in samples)
    assert parts == partition_for_dp(samples, dp)


def test_partition_equal_count_by_hand():
    samples = samples_of([(1, 9), (1, 7), (1, 5), (1, 3)])  # 10, 8, 6, 4 tokens
    assert partition_for_dp(samples, 2) == [[0, 3], [1, 2]]  # 14 vs 14
    assert partition_for_dp(samples, 2, equal_count=True) == [[0, 3], [1, 2]]
    with pytest.raises(ValueError, match="equal_count"):
        partition_for_dp(samples, 3, equal_count=True)


def test_loss_mask_of_wrong_length_is_named():
    bad = Sample(prompt_ids=[1, 2], response_ids=[3, 4, 5], loss_mask=[1, 1])
    with pytest.raises(ValueError, match="sample 0: loss_mask has 2 values for 3 response tokens"):
        pack_samples([bad])
