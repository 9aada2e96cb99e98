"""Round trips between MoEForCausalLM and `transformers` through HF checkpoint folders (fp32)."""
import pytest
import torch
import transformers

from moeloop.model import MoEForCausalLM
from moeloop.model.hf_io import INDEX_FILE, load_pretrained, save_pretrained
from tests.hf_tiny import TINY_HF_CONFIGS, hf_logits, hf_model

ARCHS = list(TINY_HF_CONFIGS)
RTOL = 1e-5  # max |ours - hf| / max |hf|: same weights, different kernels (grouped vs per-expert matmuls)


def our_logits(model: MoEForCausalLM, batch: int = 2, seq: int = 11, seed: int = 1) -> torch.Tensor:
    ids = torch.randint(0, model.cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        hidden = model.forward_packed(ids.flatten(), [seq] * batch)
        return model.compute_logits(hidden).view(batch, seq, -1)


def _assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < RTOL, f"max rel err {err:.2e}"


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_save_loads_into_ours(arch, tmp_path):
    hf = hf_model(arch)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / INDEX_FILE).is_file()
    ours = load_pretrained(tmp_path)
    assert isinstance(ours, MoEForCausalLM)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in ours.parameters())
    if ours.cfg.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    _assert_close(our_logits(ours), hf_logits(hf))


@pytest.mark.parametrize("arch", ARCHS)
def test_our_save_loads_in_transformers(arch, tmp_path):
    hf = hf_model(arch)
    hf.save_pretrained(tmp_path / "src")
    ours = load_pretrained(tmp_path / "src")
    save_pretrained(ours, tmp_path / "out", max_shard_bytes=30_000)
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert back.config.model_type == hf.config.model_type
    torch.testing.assert_close(hf_logits(back.eval()), hf_logits(hf), rtol=0, atol=0)  # weights bit-exact
    _assert_close(our_logits(ours), hf_logits(back))


def test_save_copies_tokenizer(tmp_path):
    from moeloop.model.factory import init_model
    src = init_model("qwen3_moe", "tiny", tmp_path / "src")
    save_pretrained(load_pretrained(src), tmp_path / "out", tokenizer_dir=src)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok.chat_template and tok.eos_token == "<eos>"
    with pytest.raises(ValueError, match="holds none of"):
        save_pretrained(load_pretrained(src), tmp_path / "out2", tokenizer_dir=tmp_path)


def test_load_bf16(tmp_path):
    hf = hf_model("deepseek_v3")
    hf.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    assert torch.isfinite(our_logits(ours)).all()
