"""Expert parallelism (`parallel.ep`, moeloop.parallel.expert): an MoE block with its experts split over ranks (and
sharded by FSDP over expert_dp) gives each rank's tokens the one-process output and gradients, and the one-process
expert gradients (with ranks that receive no rows at all), its local experts looping or through grouped_mm as the
experts' implementation chooses without EP; the RL loop at 2 ranks x ep 2 and 4 ranks x ep 2 (expert_dp 2) equals
1 rank; a checkpoint saved at 2 x ep 2 and at 4 x ep 2 resumes at 1 rank."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from moeloop.errors import InputError
from moeloop.model.config import ModelConfig
from moeloop.model.experts import _PLUGGED_IMPLS, cpu_grouped_mm_works
from moeloop.model.factory import init_model
from moeloop.model.moe import MoE
from moeloop.model.routes import RouteTape
from moeloop.parallel.expert import EP_IMPL, apply_ep, build_expert_mesh, reduce_expert_grads
from moeloop.parallel.fsdp import shard_experts
from tests.dist import run_ranks
from tests.test_rl_loop import STEPS, _cfg, _metrics, _weights, run_rl
from tests.test_rollout_engine import hf_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("qwen3_moe", "tiny", tmp_path_factory.mktemp("model") / "m", seed=3)


# experts impl -> the dtype its block is checked in: CPU grouped_mm has no fp64 kernel (`grouped_mm_works`)
IMPLS = {"loop": torch.float64, "auto": torch.float32}


def _block(seed: int = 0, impl: str = "loop") -> MoE:
    torch.manual_seed(seed)
    block = MoE(ModelConfig.from_hf_dict(hf_config("qwen3_moe").to_dict()), experts_impl=impl).to(IMPLS[impl])
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return block


def _inputs(rank: int, dim: int, squeeze: bool, dtype: torch.dtype) -> tuple[torch.Tensor, RouteTape | None]:
    """Rank r's tokens (3 + r of them); rank 1's are routed to experts 0 and 1 only, by a replayed route (squeezed:
    every rank's, so only rank 0's experts receive rows)."""
    g = torch.Generator().manual_seed(100 + rank)
    x_TD = torch.randn(3 + rank, dim, generator=g, dtype=torch.float64).to(dtype)
    if rank != 1 and not squeeze:
        return x_TD, None
    return x_TD, RouteTape(torch.tensor([[[0, 1]] * x_TD.shape[0]]))


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp64: to 1e-12; fp32: to 1e-5, relative or of the tensor's largest entry (its gradients reach 1e3)."""
    if want.dtype == torch.float64:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _local_path(impl: str) -> str:
    """The method the local experts of an `impl` block compute through on this CPU."""
    grouped = impl == "grouped_mm" or (impl == "auto" and cpu_grouped_mm_works())
    return "grouped_over" if grouped else "looped_over"


def _refuse(*args):
    raise AssertionError("the local experts took the other path")


def _ep_block_rank(rank, world, ep, squeeze):
    """`_ep_block_run` for each impl of IMPLS, on one mesh."""
    mesh = build_expert_mesh("cpu", ep)
    return {impl: _ep_block_run(rank, world, mesh, squeeze, impl) for impl in IMPLS}


def _ep_block_run(rank, world, mesh, squeeze, impl):
    """As the trainer runs it: experts split over ep, FSDP over expert_dp (when > 1), each rank's loss times the
    world size, `reduce_expert_grads`; the whole expert gradients gathered. The local experts' other path raises."""
    block = _block(impl=impl)
    apply_ep(block, mesh)
    other = {"grouped_over": "looped_over", "looped_over": "grouped_over"}[_local_path(impl)]
    setattr(block.experts, other, _refuse)
    shard_experts(block, MixedPrecisionPolicy(reduce_dtype=IMPLS[impl]))
    x_TD, tape = _inputs(rank, block.experts.dim, squeeze, IMPLS[impl])
    x_TD.requires_grad_(True)
    y_TD = block(x_TD, tape)
    (y_TD.square().sum() * (rank + 1) * world).backward()
    reduce_expert_grads(block)
    return (y_TD.detach(), x_TD.grad / world, block.experts.gate_up_proj.grad.full_tensor(),
            block.experts.down_proj.grad.full_tensor())


@pytest.mark.parametrize("world,ep,squeeze", [(2, 2, False), (4, 2, False), (4, 4, True)])
def test_an_ep_block_equals_one_process(world, ep, squeeze):
    """Outputs and input gradients per rank, and each rank's expert gradients summed over the ranks (its EP group's
    rows, then the expert_dp replicas), equal one process running every rank's tokens; ranks with experts no row
    reaches (and, squeezed, ranks that receive no row at all) still run every exchange. Each rank's local experts
    take the path their impl takes without EP (the other raises): "loop" loops, in fp64; "auto" takes grouped_mm
    where this torch has a CPU kernel, in fp32 (it has no fp64 kernel). Tolerance (`_assert_close`): an expert's
    product sees other row counts, the gradients sum in another order."""
    results = run_ranks(_ep_block_rank, world, ep, squeeze)
    for impl, dtype in IMPLS.items():
        block = _block(impl=impl)
        for rank, result in enumerate(results):
            y, x_grad, _, _ = result[impl]
            x_TD, tape = _inputs(rank, block.experts.dim, squeeze, dtype)
            x_TD.requires_grad_(True)
            want = block(x_TD, tape)
            (want.square().sum() * (rank + 1)).backward()
            _assert_close(y, want.detach())
            _assert_close(x_grad, x_TD.grad)
        for result in results:
            _, _, gate_up_grad, down_grad = result[impl]
            _assert_close(gate_up_grad, block.experts.gate_up_proj.grad)
            _assert_close(down_grad, block.experts.down_proj.grad)
        if squeeze:  # only experts 0 and 1 saw rows
            gate_up_grad = results[0][impl][2]
            assert gate_up_grad[2:].abs().sum() == 0 and gate_up_grad[:2].abs().sum() > 0


def _loop_rank(rank, world, model_dir, run_dir, *extra):
    calls = []
    impl = _PLUGGED_IMPLS[EP_IMPL]
    _PLUGGED_IMPLS[EP_IMPL] = lambda *a: calls.append(1) or impl(*a)
    try:
        run_rl(_cfg(model_dir, run_dir, "actor.optim.lr=1e-4", *extra))
    finally:
        _PLUGGED_IMPLS[EP_IMPL] = impl
    return len(calls)


@pytest.mark.parametrize("world", [2, 4])
def test_the_rl_loop_with_expert_parallel_equals_one_rank(model_dir, tmp_path, world):
    """2 ranks x ep 2 (each rank half the experts) and 4 ranks x ep 2 (expert_dp 2): the same rewards, losses,
    grad norms and final weights as one rank (tolerance: as test_rl_loop's DP tests); with a KL reference and the
    old-logprob pass, which run the experts split too."""
    extra = ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", "actor.ppo_mini_batch_size=4",
             "actor.ppo_epochs=2"]
    _loop_rank(0, 1, model_dir, tmp_path / "one", *extra)
    calls = run_ranks(_loop_rank, world, model_dir, tmp_path / "ep", "parallel.ep=2", *extra)
    assert all(c > 0 for c in calls)  # every rank ran its experts split
    m1, m2 = _metrics(tmp_path / "one"), _metrics(tmp_path / "ep")
    for key in ("reward/mean", "pg_loss", "grad_norm"):
        assert [m[key] for m in m2] == pytest.approx([m[key] for m in m1], rel=1e-4, abs=1e-6), key
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "ep")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=5e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_an_ep_checkpoint_resumes_at_one_rank(model_dir, tmp_path, world):
    """Saved at 2 or 4 ranks x ep 2 after 2 steps (DCP: each rank its experts' shards), resumed at 1 rank for 2
    more: the weights of 4 steps at 1 rank."""
    mini = "actor.ppo_mini_batch_size=4"  # (a mini-batch's prompts split over the ranks)
    _loop_rank(0, 1, model_dir, tmp_path / "one", mini)
    run_ranks(_loop_rank, world, model_dir, tmp_path / "split", "parallel.ep=2", f"trainer.steps={STEPS // 2}", mini)
    resumed = run_rl(_cfg(model_dir, tmp_path / "split", "actor.optim.lr=1e-4", mini), resume=True)
    assert resumed["policy/version"] == STEPS
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "split")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=5e-5)


def _bad_ep_rank(rank, world, ep):
    with pytest.raises(InputError, match=f"parallel.ep={ep} must divide"):
        apply_ep(_block(), build_expert_mesh("cpu", ep))
    return dist.get_world_size()


def test_ep_must_divide_the_ranks_and_the_experts():
    assert run_ranks(_bad_ep_rank, 2, 4) == [2, 2]  # 4 does not divide 2 ranks
