"""`moeloop init-model`: deterministic random models + local tokenizer that transformers loads."""
import hashlib

import pytest
import torch
import transformers
from safetensors import safe_open

from moeloop.cli import main as cli_main
from moeloop.model.config import ModelConfig
from moeloop.model.factory import ARCHS, build_model, hf_config_dict, init_model
from moeloop.model.hf_io import load_pretrained
from moeloop.model.tokenizer import build_tokenizer


def _digests(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    assert cli_main(["init-model", "--arch", request.param, "--size", "tiny", "--out", str(out)]) == 0
    return request.param, out


def test_tiny_loads_in_transformers_with_same_logits(tiny):
    arch, out = tiny
    assert transformers.AutoConfig.from_pretrained(out).model_type == arch
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ours = load_pretrained(out)
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf.eval()(input_ids=ids).logits
        got = ours.compute_logits(ours.forward_packed(ids.flatten(), [9, 9])).view_as(ref)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_tokenizer_and_chat_template(tiny):
    _, out = tiny
    tok = transformers.AutoTokenizer.from_pretrained(out)
    cfg = ModelConfig.from_pretrained(out)
    assert len(tok) <= cfg.vocab_size and cfg.vocab_size % 64 == 0
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (cfg.pad_token_id, cfg.bos_token_id,
                                                                      cfg.eos_token_id)
    text = "Hi, 2+2=4?\n(yes)"
    assert tok.decode(tok(text)["input_ids"]) == text
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == \
        "<bos><|system|>Be brief.\n<|user|>2+2?\n<|assistant|>4<eos>"
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|user|>2+2?\n<|assistant|>")
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.convert_ids_to_tokens(ids[-1]) == "<|assistant|>"
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "function", "content": "x"}], tokenize=False)
    tool = tok.apply_chat_template(msgs + [{"role": "tool", "content": "5"}], tokenize=False, add_generation_prompt=True)
    assert tool.endswith("<|assistant|>4<eos><|user|><tool_response>5</tool_response>\n<|assistant|>")


def test_same_seed_gives_identical_files(tmp_path):
    a = init_model("deepseek_v3", "tiny", tmp_path / "a", seed=3)
    b = init_model("deepseek_v3", "tiny", tmp_path / "b", seed=3)
    c = init_model("deepseek_v3", "tiny", tmp_path / "c", seed=4)
    assert _digests(a) == _digests(b)
    assert _digests(a)["model.safetensors"] != _digests(c)["model.safetensors"]
    assert _digests(a)["tokenizer.json"] == _digests(c)["tokenizer.json"]


def test_init_statistics_and_deepseek_bias(tmp_path):
    state = build_model("deepseek_v3", "tiny", seed=0).state_dict()
    router = state["model.layers.1.mlp.gate.weight"]
    assert 0.01 < router.std().item() < 0.03
    assert 0.01 < state["model.layers.1.mlp.experts.gate_up_proj"].std().item() < 0.03
    bias = state["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().max() > 0 and bias.abs().max() < 0.1
    assert torch.equal(state["model.norm.weight"], torch.ones(64))
    before = torch.get_rng_state()
    build_model("qwen3_moe", "tiny", seed=1)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is left alone


def test_size_configs():
    ds = ModelConfig.from_hf_dict(hf_config_dict("deepseek_v3", "tiny"))
    assert (ds.n_group, ds.topk_group, ds.n_shared_experts, ds.moe_layers) == (2, 1, 1, [1, 2])
    assert ds.q_lora_rank and ds.rope_scaling["rope_type"] == "yarn"
    small = ModelConfig.from_hf_dict(hf_config_dict("qwen3_moe", "small"))
    assert (small.hidden_size, small.num_layers, small.num_experts, small.num_experts_per_tok,
            small.moe_intermediate_size, small.num_heads) == (128, 4, 8, 2, 128, 4)
    ref = ModelConfig.from_hf_dict(hf_config_dict("qwen3_moe", "reference"))
    assert (ref.hidden_size, ref.num_layers, ref.num_experts, ref.num_experts_per_tok, ref.moe_intermediate_size,
            ref.num_heads, ref.num_kv_heads, ref.head_dim, ref.vocab_size) == (1536, 16, 64, 4, 512, 12, 4, 128, 32000)
    assert len(build_tokenizer()) <= ref.vocab_size


def test_bf16_output_and_bad_arguments(tmp_path, capsys):
    out = init_model("qwen3_moe", "tiny", tmp_path / "bf16", dtype="bfloat16")
    with safe_open(out / "model.safetensors", framework="pt") as h:
        assert h.get_tensor("model.layers.0.mlp.experts.3.up_proj.weight").dtype == torch.bfloat16
    with pytest.raises(ValueError, match="arch='gpt2'"):
        init_model("gpt2", "tiny", tmp_path / "x")
    with pytest.raises(SystemExit):
        cli_main(["init-model", "--arch", "qwen3_moe", "--size", "huge", "--out", str(tmp_path / "y")])
    assert "invalid choice" in capsys.readouterr().err
