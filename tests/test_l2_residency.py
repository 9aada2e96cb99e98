"""The lm_head's L2 persisting window (`rollout.l2_residency`, MOELOOP_L2_PERSIST): the setting's check, the hit
ratio, the runtime structs' layout, and on CUDA that decode with the window gives the same tokens and logprobs."""
from __future__ import annotations

import ctypes

import pytest
import torch

from moeloop.errors import InputError
from moeloop.rollout import SamplingParams, l2_residency
from tests.test_rollout_engine import make_engine, prompts, tiny_model


def test_hit_ratio_is_the_share_of_the_window_that_fits_the_set_aside():
    assert l2_residency.hit_ratio(10 << 20, 30 << 20) == 1.0
    assert l2_residency.hit_ratio(30 << 20, 30 << 20) == 1.0
    assert l2_residency.hit_ratio(98 << 20, 49 << 20) == 0.5


def test_setting_is_checked(monkeypatch):
    monkeypatch.setattr(l2_residency, "L2_PERSIST", "lm-head")
    with pytest.raises(InputError, match="MOELOOP_L2_PERSIST"):
        l2_residency.choice()
    monkeypatch.setattr(l2_residency, "L2_PERSIST", "off")
    assert l2_residency.window_for(tiny_model("qwen3_moe")) is None


def test_runtime_structs_have_the_cuda_layout():
    """cudaAccessPolicyWindow: pointer, size_t, float, two enums (28 bytes, 32 with its 8-byte alignment); the
    stream attribute value is a 64-byte union."""
    assert ctypes.sizeof(l2_residency._AccessPolicyWindow) == 32
    assert l2_residency._AccessPolicyWindow.hitRatio.offset == 16
    assert l2_residency._AccessPolicyWindow.missProp.offset == 24
    assert ctypes.sizeof(l2_residency._StreamAttrValue) == 64


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 8,
                    reason="persisting L2 windows need a CUDA device of compute capability 8 or more")
def test_decode_with_the_window_changes_no_token_or_logprob(monkeypatch):
    """B=1 and B=3 decode through CUDA graphs captured with the lm_head window against without: the same tokens
    and logprobs (the window only changes what the L2 keeps); the window was applied; sleep releases it."""
    model = tiny_model("qwen3_moe").to("cuda", torch.bfloat16)
    params = SamplingParams(temperature=1.0, top_k=20, max_tokens=12, seed=3)
    cases = [prompts(1, seed=5), prompts(3, seed=6)]
    ref = [make_engine(model).generate(ps, params) for ps in cases]
    monkeypatch.setattr(l2_residency, "L2_PERSIST", "lm_head")
    applied = []
    apply = l2_residency.L2Window.apply
    monkeypatch.setattr(l2_residency.L2Window, "apply", lambda self, s: applied.append(self) or apply(self, s))
    engine = make_engine(model)
    window = engine.runner.graphs.l2_window
    assert window is not None and window.tensor is model.lm_head.weight and 0 < window.hit_ratio <= 1
    for ps, expected in zip(cases, ref):
        outs = engine.generate(ps, params)
        assert [o.response_ids for o in outs] == [o.response_ids for o in expected]
        assert [o.logprobs for o in outs] == [o.logprobs for o in expected]
    assert applied
    engine.pause()
    engine.drain()
    engine.sleep()  # drops the graphs and demotes the persisting lines (raises if the runtime call fails)
    engine.wake()
    engine.resume()
    assert [o.response_ids for o in engine.generate(cases[0], params)] == [o.response_ids for o in ref[0]]
