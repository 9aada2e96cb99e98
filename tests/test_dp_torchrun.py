"""DP through the real entrance: `torchrun --nproc_per_node 2 -m moeloop rl` gives the losses and weights one
process gives on the same global batch, and its checkpoint resumes in one process. On CPU over gloo (in the default
suite: it is what the README's torchrun command runs) and on two GPUs over NCCL (needs 2 CUDA devices). The
fork-launched gloo twins in test_rl_loop.py and test_checkpoint.py initialise the group themselves; this one goes
through `RunEnv`'s own process-group setup.

Tolerance: fp32 (on GPU with TF32 off, torch's default for matmuls); the two layouts differ in GEMM shapes (each rank
runs half the batch) and in the all-reduce's sum order, so the weights are compared at atol 5e-5 after 4 Adam steps
of lr 1e-4, as in test_rl_loop.py. Sampling is keyed by (seed, token index), so both layouts draw the same responses
unless a logit difference of that order flips a draw; the reward means and policy losses are compared too."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moeloop.model.factory import init_model
from moeloop.model.hf_io import load_pretrained

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (DP over NCCL)")
# (the CPU expert-parallel runs are test_expert_parallel.py's fork-launched gloo twins)
LAYOUTS = [("cpu", ()), pytest.param("cuda", (), marks=TWO_GPUS), pytest.param("cuda", ("parallel.ep=2",), marks=TWO_GPUS)]

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4


def _settings(device: str, model_dir: Path, run_dir: Path, steps: int) -> list[str]:
    return [f"model.path={model_dir}", f"trainer.run_dir={run_dir}", f"trainer.steps={steps}", "trainer.log=[jsonl]",
            f"trainer.device={device}", "data.train_files=[synthetic:arith]", "data.max_prompt_length=64",
            "data.max_response_length=4", "data.train_batch_size=4", "rollout.n=4",
            "reward.fn=tests.test_rl_loop.digit_reward", "actor.optim.lr=1e-4", "actor.ppo_mini_batch_size=2",
            "actor.max_tokens_per_micro_batch=72", "checkpoint.export_hf_every=0", "checkpoint.save_every=2",
            "algorithm.norm_adv_by_std=false"]


def _run(ranks: int, cfg: Path, settings: list[str], resume: bool = False) -> None:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
                if ranks > 1 else [sys.executable])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")  # (CPU ranks share the CI's 2 cores)
    if ranks == 1:
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    cmd = launcher + ["-m", "moeloop", "rl", str(cfg), *settings] + (["--resume"] if resume else [])
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _max_diff(a: Path, b: Path) -> float:
    wa, wb = load_pretrained(a / "hf").state_dict(), load_pretrained(b / "hf").state_dict()
    assert wa.keys() == wb.keys()
    return max((wa[n] - wb[n]).abs().max().item() for n in wa)


@pytest.mark.parametrize("device,layout", LAYOUTS)
def test_torchrun_dp2_matches_one_process_and_resumes_in_one(tmp_path, device, layout):
    """`layout`: the 2-rank runs' settings (parallel.ep=2: each GPU half the experts, tokens exchanged over NCCL)."""
    model_dir = init_model("qwen3_moe", "tiny", tmp_path / "model", seed=3)
    cfg = tmp_path / "rl.yaml"
    cfg.write_text("{}\n")
    one, two, resumed = tmp_path / "one", tmp_path / "two", tmp_path / "two_then_one"
    _run(1, cfg, _settings(device, model_dir, one, STEPS))
    _run(2, cfg, _settings(device, model_dir, two, STEPS) + list(layout))
    # one process goes on from the 2-rank run's step-2 checkpoint (save_every=2; keep=2 holds steps 2 and 4): one
    # torchrun launch fewer than a separate 2-rank run stopped at step 2, whose checkpoint would be the same state
    halfway = two / "checkpoints" / f"step_{STEPS // 2:06d}"
    _run(1, cfg, _settings(device, model_dir, resumed, STEPS) + [f"checkpoint.resume_from={halfway}"])
    r1, r2, r3 = _rows(one), _rows(two), _rows(resumed)
    assert len(r1) == len(r2) == STEPS and [r["step"] for r in r3] == list(range(STEPS // 2 + 1, STEPS + 1))
    assert r2[-1]["policy/version"] == STEPS
    before = load_pretrained(model_dir).state_dict()
    trained = load_pretrained(one / "hf").state_dict()
    assert max((trained[n] - before[n]).abs().max().item() for n in before) > 1e-4  # it trained
    d_two, d_resumed = _max_diff(one, two), _max_diff(one, resumed)
    print(f"\n{device} {layout}: reward/mean 1 rank {[r['reward/mean'] for r in r1]}\n            2 ranks "
          f"{[r['reward/mean'] for r in r2]}\n     2 then 1 rank {[r['reward/mean'] for r in r3]}\n"
          f"max |w(2 ranks) - w(1 rank)| {d_two:.3e}, max |w(2 then 1) - w(1 rank)| {d_resumed:.3e}")
    for rows in (r2, r3):  # (the resumed run logs the steps after the checkpoint)
        ref = r1[-len(rows):]
        assert [r["reward/mean"] for r in rows] == pytest.approx([r["reward/mean"] for r in ref])
        assert [r["pg_loss"] for r in rows] == pytest.approx([r["pg_loss"] for r in ref], rel=1e-3, abs=1e-6)
    assert d_two <= 5e-5 and d_resumed <= 5e-5
