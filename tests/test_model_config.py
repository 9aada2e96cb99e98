"""ModelConfig: bad config.json input fails with the key named; both rope spellings load."""
import json

import pytest

from moeloop.model.config import ModelConfig
from tests.hf_tiny import hf_config


def test_unsupported_architecture_names_the_key(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"config.json: model_type='gpt2' is not supported .*GPT2LMHeadModel"):
        ModelConfig.from_pretrained(tmp_path)


def test_missing_and_inconsistent_keys_are_named():
    raw = hf_config("qwen3_moe").to_dict()
    del raw["num_experts_per_tok"]
    with pytest.raises(ValueError, match="missing required key 'num_experts_per_tok'"):
        ModelConfig.from_hf_dict(raw)
    raw = hf_config("qwen3_moe").to_dict() | {"num_key_value_heads": 3}
    with pytest.raises(ValueError, match="num_key_value_heads: 3 must divide num_attention_heads=4"):
        ModelConfig.from_hf_dict(raw)
    raw = hf_config("deepseek_v3").to_dict() | {"topk_group": 9}
    with pytest.raises(ValueError, match="topk_group"):
        ModelConfig.from_hf_dict(raw)


def test_invalid_json_and_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_pretrained(tmp_path)


def test_rope_spellings_agree():
    old = {**hf_config("qwen3_moe").to_dict()}
    old.pop("rope_parameters", None)
    old.update(rope_theta=5e5, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
    new = {**old, "rope_parameters": {"rope_theta": 5e5, "rope_type": "yarn", "factor": 4.0,
                                       "original_max_position_embeddings": 64}}
    new.pop("rope_theta"), new.pop("rope_scaling")
    a, b = ModelConfig.from_hf_dict(old), ModelConfig.from_hf_dict(new)
    assert (a.rope_theta, a.rope_scaling) == (b.rope_theta, b.rope_scaling) == (5e5, {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})
