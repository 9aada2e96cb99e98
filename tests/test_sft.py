"""The SFT entrance end to end on a tiny model: it learns, its HF export is directly the RL input, a resumed run
equals the straight one, and `trainer.epochs` counts a partial last batch as a step."""
import json

import pytest
import torch

from moeloop.config import load_config
from moeloop.loop.rl import run_rl
from moeloop.loop.sft import run_sft
from moeloop.model.factory import init_model
from moeloop.model.hf_io import load_pretrained


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("qwen3_moe", "tiny", tmp_path_factory.mktemp("model") / "m", seed=1)


def _cfg(model_dir, run_dir, *extra):
    """On CPU (as the RL loop's tests): bitwise resume equality, and one device per rank on any machine."""
    return load_config("examples/tiny_sft.yaml", [
        "trainer.device=cpu", f"model.path={model_dir}", f"trainer.run_dir={run_dir}", "trainer.log=[jsonl]", "trainer.steps=6",
        "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", "actor.optim.warmup_steps=0",
        "actor.optim.min_lr_ratio=1.0", *extra])


def _losses(run_dir):
    return [json.loads(line)["sft_loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_learns_and_its_export_is_the_rl_input(model_dir, tmp_path):
    run_sft(_cfg(model_dir, tmp_path / "sft"))
    losses = _losses(tmp_path / "sft")
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5, losses
    before, after = load_pretrained(model_dir).state_dict(), load_pretrained(tmp_path / "sft" / "hf").state_dict()
    assert any(not torch.equal(before[n], after[n]) for n in before)
    rl = load_config("examples/tiny.yaml", [
        f"model.path={tmp_path / 'sft' / 'hf'}", f"trainer.run_dir={tmp_path / 'rl'}", "trainer.log=[jsonl]",
        "trainer.device=cpu", "trainer.steps=1", "trainer.val_every=0", "data.val_files=[]", "data.train_batch_size=4", "rollout.n=4",
        "actor.ppo_mini_batch_size=4", "checkpoint.save_final=false"])
    assert run_rl(rl)["policy/version"] == 1


def test_resumed_sft_equals_the_straight_run(model_dir, tmp_path):
    run_sft(_cfg(model_dir, tmp_path / "a"))
    run_sft(_cfg(model_dir, tmp_path / "b", "trainer.steps=3"))
    run_sft(_cfg(model_dir, tmp_path / "b"), resume=True)
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")
    wa, wb = (load_pretrained(tmp_path / r / "hf").state_dict() for r in ("a", "b"))
    assert all(torch.equal(wa[n], wb[n]) for n in wa)


def test_epochs_count_a_partial_last_batch(model_dir, tmp_path):
    """20 rows in batches of 16: an epoch is 2 steps, 2 epochs 3 (it was 20 // 16 = 1, and 0 for a file smaller
    than one batch)."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "response": str(i + 1)}) + "\n" for i in range(20)))
    for epochs, steps in ((1, 2), (2, 3)):
        run_dir = tmp_path / f"e{epochs}"
        run_sft(_cfg(model_dir, run_dir, f"data.train_files=[{data}]", f"trainer.epochs={epochs}"))
        assert len(_losses(run_dir)) == steps
    run_sft(_cfg(model_dir, tmp_path / "small", f"data.train_files=[{data}]", "trainer.epochs=1",
                 "data.train_batch_size=32", "actor.ppo_mini_batch_size=32"))
    assert len(_losses(tmp_path / "small")) == 1


def _sft_rank(rank, world, model_dir, run_dir, *extra):
    run_sft(_cfg(model_dir, run_dir, *extra))
    return True


def test_sft_on_2_ranks_matches_1_rank(model_dir, tmp_path):
    """Each rank takes its slice of the global batch; the loss is normalised by the global token count, so 2 gloo
    ranks (FSDP2) give 1 rank's losses and weights (fp32; tolerance as the RL loop's DP tests). A batch the ranks
    cannot split evenly is refused."""
    from tests.dist import run_ranks
    _sft_rank(0, 1, model_dir, tmp_path / "one", "trainer.steps=3")
    run_ranks(_sft_rank, 2, model_dir, tmp_path / "two", "trainer.steps=3")
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    w1, w2 = (load_pretrained(tmp_path / r / "hf").state_dict() for r in ("one", "two"))
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=5e-5)
    with pytest.raises(Exception, match="data.train_batch_size=15 must be divisible by the 2 data-parallel ranks"):
        run_ranks(_sft_rank, 2, model_dir, tmp_path / "odd", "data.train_batch_size=15", "actor.ppo_mini_batch_size=15")
