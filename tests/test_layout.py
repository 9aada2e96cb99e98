"""Layout: every divisibility rule named, Megatron-style expert-DP, uneven pipeline stages."""

from moeloop.model.config import ModelConfig
from moeloop.parallel import BatchInfo, Layout

QWEN = {"model_type": "qwen3_moe", "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 12,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 16, "num_experts": 64,
        "num_experts_per_tok": 4, "moe_intermediate_size": 128}


def model(**over):
    return ModelConfig.from_hf_dict({**QWEN, **over})


def test_valid_layout_has_no_problems_and_expert_dp_follows_parallel_folding():
    lay = Layout(dp=4, tp=2, pp=2, ep=8, etp=1)
    assert lay.validate(model(), world_size=16) == []
    assert lay.world_size == 16 and lay.dp_cp == 4
    assert lay.expert_dp == 4 * 1 * 2 // 8 == 1
    assert Layout(dp=40, ep=8).expert_dp == 5


def test_ep_must_divide_data_context_tensor_ranks():
    problems = Layout(dp=12, ep=8).validate(model(), world_size=12)
    assert problems == ["ep*etp = 8*1 = 8 must divide dp*cp*tp = 12*1*1 = 12 "
                        "(experts are folded into the data/context/tensor ranks of a stage)"]
    lay = Layout(dp=3, tp=4, ep=4, etp=3)  # ep*etp = 12 = dp*tp: every rank of the stage is an expert shard
    assert lay.expert_dp == 1
    assert lay.validate(model(num_attention_heads=16), world_size=12) == ["moe_intermediate_size=128 % etp=3 != 0"]


def test_every_violated_rule_is_reported_at_once():
    lay = Layout(dp=3, tp=8, pp=5, vpp=3, ep=6, etp=1)
    problems = lay.validate(model(num_attention_heads=12, num_key_value_heads=6), world_size=100,
                            batch=BatchInfo(mini_batch_samples=2))
    text = "\n".join(problems)
    assert "world size 100 != dp*tp*pp*cp" in text
    assert "num_attention_heads=12 % tp=8 != 0" in text
    assert "num_key_value_heads=6 % tp=8 != 0" in text
    assert "num_experts=64 % ep=6 != 0" in text
    assert ("num_layers=12: 12 layers for 15 pipeline chunks (pp*vpp = 5*3): every chunk needs one layer at least"
            in text)
    assert "samples per mini-batch 2 < dp=3" in text
    assert len(problems) == 6


def test_tp_above_the_kv_heads_is_a_multiple_of_them():
    """Each kv head then on tp / G ranks (`parallel.tensor.keep_kv_head`): Qwen3-30B-A3B's 4 at tp 8."""
    assert Layout(tp=8).validate(model(num_attention_heads=32, num_key_value_heads=4), world_size=8) == []
    assert Layout(tp=8).validate(model(num_attention_heads=24, num_key_value_heads=6), world_size=8) == [
        "num_key_value_heads=6 % tp=8 != 0 and tp % num_key_value_heads = 2 != 0 (tp must divide the kv heads or be "
        "a multiple of them)"]


def test_sizes_and_dense_model_rules():
    assert Layout(dp=0).validate() == ["dp=0 must be >= 1"]
    dense = ModelConfig.from_hf_dict({"model_type": "qwen3", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4,
                                      "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96})
    assert any("dense model" in p for p in Layout(dp=2, ep=2).validate(dense))
    assert Layout(vpp=2).validate() == ["vpp=2 needs pp > 1"]
    assert Layout(dp=2, cp=2).validate(dense) == []  # (Ulysses: no token rule; the stream is padded to cp rows)
    assert Layout(cp=3).validate(dense) == ["num_attention_heads=4 % (tp*cp) = 4 % 3 != 0 (context parallelism "
                                            "splits the heads over cp)"]


def test_uneven_pipeline_like_verl_dsv3_demo():
    lay = Layout(dp=1, tp=8, pp=12, ep=8, last_stage_layers=6)
    assert lay.stage_layers(61) == [5] * 11 + [6]
    assert lay._pipeline_rules(61) == []
    assert lay._pipeline_rules(16) == ["num_layers=16: 10 layers for 11 pipeline chunks (pp*vpp = 12*1 less the "
                                       "first/last stage): every chunk needs one layer at least"]
    assert lay._pipeline_rules(4) == ["first_stage_layers=0 + last_stage_layers=6 do not fit num_layers=4 with pp=12"]
    # without first/last counts the runtime splits unevenly (the earlier stages one more), and so does the plan
    assert Layout(pp=12).validate(model(num_hidden_layers=61)) == []
    assert Layout(pp=12).stage_layers(61) == [6] + [5] * 11
    assert Layout(pp=4, first_stage_layers=2, last_stage_layers=2).stage_layers(12) == [2, 4, 4, 2]


def test_interleaved_chunks_take_runs_of_layers_round_robin_over_the_stages():
    """Chunk k of pp * vpp holds the k-th run of layers and sits on stage k % pp (Megatron's virtual pipeline)."""
    lay = Layout(pp=2, vpp=2)
    assert lay.chunk_layers(8) == [2, 2, 2, 2] and lay.stage_layers(8) == [4, 4]
    assert lay.chunk_layers(6) == [2, 2, 1, 1] and lay.stage_layers(6) == [3, 3]
    assert Layout(pp=3, vpp=2).chunk_layers(7) == [2, 1, 1, 1, 1, 1]
    assert Layout(pp=3, vpp=2).stage_layers(7) == [3, 2, 2]
    # a first or last stage's count splits over that stage's vpp chunks (earlier ones more), the rest over the others'
    uneven = Layout(pp=3, vpp=2, first_stage_layers=5, last_stage_layers=2)
    assert uneven.chunk_layers(13) == [3, 3, 1, 2, 3, 1] and uneven.stage_layers(13) == [5, 6, 2]
    assert [list(map(list, uneven.stage_chunks(13, s))) for s in range(3)] == [
        [[0, 1, 2], [7, 8]], [[3, 4, 5], [9, 10, 11]], [[6], [12]]]
    assert uneven._pipeline_rules(13) == []
    assert Layout(pp=2, vpp=2, last_stage_layers=1)._pipeline_rules(6) == [
        "last_stage_layers=1 < vpp=2: each of the stage's vpp chunks needs one layer at least"]
    assert Layout(pp=3, vpp=2, first_stage_layers=2, last_stage_layers=2)._pipeline_rules(5) == [
        "num_layers=5: 1 layers for 2 pipeline chunks (pp*vpp = 3*2 less the first/last stage): every chunk needs one "
        "layer at least"]


def test_with_world_keeps_model_parallel_shape():
    lay = Layout(dp=4, tp=2, pp=2, ep=4)
    assert lay.with_world(24) == Layout(dp=6, tp=2, pp=2, ep=4)
    assert lay.with_world(10) is None


def test_context_parallel_exchange_buffers_are_planned():
    """Ulysses' q, k, v and output exchanges of one attention, sent and received (benchmarks/context_parallel.py
    measures what they move): with 2 kv heads over cp 2 they divide; over cp 4 they are repeated to the 4 query heads."""
    from moeloop.plan.activations import alltoall_bytes
    m = ModelConfig.from_hf_dict({"model_type": "qwen3", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                  "intermediate_size": 96})
    assert alltoall_bytes(m, Layout(cp=1), 100) == 0
    assert alltoall_bytes(m, Layout(cp=2), 100) == 2 * 100 * (4 + 2 + 2 + 4) * 16 * 2
    assert alltoall_bytes(m, Layout(cp=4), 100) == 2 * 100 * (4 + 4 + 4 + 4) * 16 * 2
