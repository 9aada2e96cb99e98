"""HF checkpoint import/export: hub per-expert names, sharding, round trips through `transformers`, named errors.

These run against `transformers` models, whose state_dict names are our in-memory names;
tests/test_model_io_ours.py repeats the round trips with MoEForCausalLM.
"""
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from moeloop.model.hf_io import INDEX_FILE, load_weights, save_pretrained
from moeloop.model.hf_names import fuse_hub_tensors, hub_named_tensors, parse_hub_name
from tests.hf_tiny import TINY_HF_CONFIGS, hf_logits, hf_model, moeloop_config

ARCHS = [a for a in TINY_HF_CONFIGS if a != "llama_tied"]  # MoE only; ours covers the tied dense case


def _file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.fixture(scope="module", params=ARCHS)
def hf_saved(request, tmp_path_factory):
    """(arch, model, folder written by transformers.save_pretrained in several shards)."""
    model = hf_model(request.param)
    folder = tmp_path_factory.mktemp(f"hf_{request.param}")
    model.save_pretrained(folder, max_shard_size="40KB")
    return request.param, model, folder


def test_hub_names_and_values_match_transformers_save(hf_saved):
    arch, model, folder = hf_saved
    on_disk = _file_tensors(folder)
    ours = dict(hub_named_tensors(model.state_dict().items(), moeloop_config(model)))
    assert sorted(ours) == sorted(on_disk)
    for name, t in ours.items():
        assert torch.equal(t, on_disk[name]), name
    if arch == "mixtral":
        assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in ours


def test_fuse_inverts_hub_names(hf_saved):
    _, model, _ = hf_saved
    cfg = moeloop_config(model)
    sd = model.state_dict()
    hub = list(hub_named_tensors(sd.items(), cfg))
    fused = dict(fuse_hub_tensors(reversed(hub), cfg))  # any arrival order
    assert sorted(fused) == sorted(sd)
    for name, t in sd.items():
        assert torch.equal(fused[name], t), name


def test_transformers_save_loads_via_load_weights(hf_saved):
    arch, model, folder = hf_saved
    assert len(json.loads((folder / INDEX_FILE).read_text())["weight_map"]) > 0
    assert len(list(folder.glob("*.safetensors"))) > 1
    fresh = hf_model(arch, seed=123)
    assert not torch.equal(hf_logits(fresh), hf_logits(model))
    load_weights(fresh, folder, moeloop_config(model))
    torch.testing.assert_close(hf_logits(fresh), hf_logits(model), rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_our_save_loads_in_transformers(arch, tmp_path):
    model = hf_model(arch)
    save_pretrained(model, tmp_path, cfg=moeloop_config(model), max_shard_bytes=30_000)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert all(not parse_hub_name(n)[0].endswith("gate_up_proj") or parse_hub_name(n)[1] is not None
               for n in index["weight_map"])  # per-expert names only
    assert transformers.AutoConfig.from_pretrained(tmp_path).model_type == arch
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    torch.testing.assert_close(hf_logits(loaded.eval()), hf_logits(model), rtol=0, atol=0)


def test_single_file_and_fused_names_on_disk_load(tmp_path):
    model = hf_model("qwen3_moe")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    fresh = hf_model("qwen3_moe", seed=5)
    load_weights(fresh, tmp_path, moeloop_config(model))
    torch.testing.assert_close(hf_logits(fresh), hf_logits(model), rtol=0, atol=0)


def test_resave_in_fewer_shards_removes_stale_files(tmp_path):
    model = hf_model("qwen3_moe")
    cfg = moeloop_config(model)
    save_pretrained(model, tmp_path, cfg=cfg, max_shard_bytes=30_000)
    save_pretrained(model, tmp_path, cfg=cfg)
    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    assert not (tmp_path / INDEX_FILE).exists()
    fresh = hf_model("qwen3_moe", seed=7)
    load_weights(fresh, tmp_path, cfg)
    torch.testing.assert_close(hf_logits(fresh), hf_logits(model), rtol=0, atol=0)


def _rewrite(folder: Path, edit) -> None:
    """Apply `edit(dict)` to the tensors of every shard file, in place."""
    for f in folder.glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        edit(tensors)
        save_file(tensors, f, metadata={"format": "pt"})


@pytest.mark.parametrize("case", ["missing", "unexpected", "shape"])
def test_bad_checkpoint_errors_name_the_tensor(case, tmp_path):
    model = hf_model("mixtral")
    cfg = moeloop_config(model)
    save_pretrained(model, tmp_path, cfg=cfg, max_shard_bytes=30_000)
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"

    def edit(tensors):
        if name in tensors:
            if case == "missing":
                del tensors[name]
            elif case == "shape":
                tensors[name] = tensors[name][:, :-1].contiguous()
            else:
                tensors["model.layers.1.block_sparse_moe.experts.9.w2.weight"] = tensors[name].clone()
    _rewrite(tmp_path, edit)
    shard = json.loads((tmp_path / INDEX_FILE).read_text())["weight_map"][name]
    fresh = hf_model("mixtral", seed=1)
    expected = {"missing": f"missing tensor '{name}'",
                "unexpected": "unexpected tensor 'model.layers.1.block_sparse_moe.experts.9.w2.weight'",
                "shape": f"tensor '{name}' in .*{shard} has shape \\(64, 47\\), the model expects \\(64, 48\\)"}
    with pytest.raises(ValueError, match=expected[case]):
        load_weights(fresh, tmp_path, cfg)


def test_load_into_bf16(tmp_path):
    model = hf_model("deepseek_v3")
    cfg = moeloop_config(model)
    save_pretrained(model, tmp_path, cfg=cfg)
    fresh = hf_model("deepseek_v3", seed=3)
    load_weights(fresh, tmp_path, cfg, dtype=torch.bfloat16)
    params = dict(fresh.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    assert fresh.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32  # buffers keep theirs
    ref = model.model.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(params["model.layers.1.mlp.experts.gate_up_proj"], ref.to(torch.bfloat16))


def test_fuse_reports_incomplete_experts():
    model = hf_model("qwen3_moe")
    cfg = moeloop_config(model)
    hub = [(n, t) for n, t in hub_named_tensors(model.state_dict().items(), cfg)
           if n != "model.layers.0.mlp.experts.5.up_proj.weight"]
    with pytest.raises(ValueError, match=r"layers.0.mlp.experts.gate_up_proj: incomplete experts.*'5.up_proj'"):
        list(fuse_hub_tensors(hub, cfg))


def test_deepseek_mtp_layers_are_skipped_other_extra_layers_are_not(tmp_path):
    for arch in ("deepseek_v3", "qwen3_moe"):
        model = hf_model(arch)
        cfg = moeloop_config(model)
        folder = tmp_path / arch
        save_pretrained(model, folder, cfg=cfg)
        extra = f"model.layers.{cfg.num_layers}.eh_proj.weight"  # DeepSeek-V3's multi-token-prediction layer
        _rewrite(folder, lambda tensors: tensors.__setitem__(extra, torch.zeros(4, 4)))
        fresh = hf_model(arch, seed=2)
        if arch == "deepseek_v3":
            load_weights(fresh, folder, cfg)
            torch.testing.assert_close(hf_logits(fresh), hf_logits(model), rtol=0, atol=0)
        else:
            with pytest.raises(ValueError, match=f"unexpected tensor '{extra}'"):
                load_weights(fresh, folder, cfg)


def test_mixtral_accepts_the_generic_expert_spelling(tmp_path):
    """Some Mixtral exports use mlp.experts.{e}.gate_proj/up_proj/down_proj instead of block_sparse_moe w1/w3/w2."""
    model = hf_model("mixtral")
    cfg = moeloop_config(model)
    qwen_naming = moeloop_config(hf_model("qwen3_moe"))
    generic = {n: t.clone() for n, t in hub_named_tensors(model.state_dict().items(), qwen_naming)}
    assert any(".mlp.experts.0.gate_proj." in n for n in generic)
    save_file(generic, tmp_path / "model.safetensors")
    fresh = hf_model("mixtral", seed=4)
    load_weights(fresh, tmp_path, cfg)
    torch.testing.assert_close(hf_logits(fresh), hf_logits(model), rtol=0, atol=0)
