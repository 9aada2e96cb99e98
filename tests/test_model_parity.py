"""Our model == transformers 5 on the same random weights, fp32: parameter names/shapes, logits, loss
gradients of every parameter, and the load-balance aux loss.

Tolerances (max |ours - hf| / max |hf|): logits 1e-5, gradients 1e-4 (per parameter).
"""
import pytest
import torch
import torch.nn.functional as F

from tests.model_pairs import ARCHS, hf_model, max_rel_err, our_model, token_batch

LOGITS_RTOL, GRAD_RTOL = 1e-5, 1e-4


def _our_logits(model, ids_BS):
    B, S = ids_BS.shape
    return model.compute_logits(model.forward_packed(ids_BS.reshape(-1), [S] * B)).view(B, S, -1)


def _next_token_loss(logits_BSV, ids_BS):
    return F.cross_entropy(logits_BSV[:, :-1].reshape(-1, logits_BSV.shape[-1]), ids_BS[:, 1:].reshape(-1))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_state_dict_names_and_shapes_match_hf(arch):
    hf = hf_model(arch)
    ours = our_model(hf)
    hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    our_shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    assert our_shapes == hf_shapes
    hf.load_state_dict(ours.state_dict(), strict=True)
    hf_params = {k for k, _ in hf.named_parameters()}
    assert {k for k, _ in ours.named_parameters()} == hf_params  # buffers stay buffers


@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_hf(arch):
    hf = hf_model(arch)
    ours = our_model(hf)
    ids = token_batch(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=ids).logits
        got = _our_logits(ours, ids)
    assert max_rel_err(got, ref) < LOGITS_RTOL


@pytest.mark.parametrize("arch", list(ARCHS))
def test_loss_gradients_match_hf(arch):
    hf = hf_model(arch)
    ours = our_model(hf)
    ids = token_batch(hf.config.vocab_size)
    _next_token_loss(hf(input_ids=ids).logits, ids).backward()
    _next_token_loss(_our_logits(ours, ids), ids).backward()
    hf_grads = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        ref = hf_grads[name].grad
        assert p.grad is not None and ref is not None, name
        if ref.abs().max() > 0:
            assert max_rel_err(p.grad, ref) < GRAD_RTOL, name


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_load_balance_loss_matches_hf_aux_loss(arch):
    hf = hf_model(arch)
    ours = our_model(hf)
    ids = token_batch(hf.config.vocab_size)
    with torch.no_grad():
        ref = hf(input_ids=ids, output_router_logits=True).aux_loss
        _our_logits(ours, ids)
    assert abs(ours.load_balance_loss().item() - ref.item()) < 1e-6 * max(1.0, abs(ref.item()))


def test_deepseek_group_limit_changes_the_selection():
    """Guards the parity test: with these weights, group-limited routing differs from a plain top-k."""
    ours = our_model(hf_model("deepseek_v3"))
    gate = ours.moe_blocks()[0].gate
    x = torch.randn(64, ours.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    limited = gate(x).ids_TK.sort(-1).values
    gate.n_group = gate.topk_group = 1
    plain = gate(x).ids_TK.sort(-1).values
    assert not torch.equal(limited, plain)
