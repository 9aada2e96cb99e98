"""rollout.mode=disaggregated (`loop.remote_rollout`): the engine in a process of its own. It generates what the
in-process engine generates (max_staleness=0: what colocated does; 1: what async does), the weights reach it as
buckets that it verifies on arrival, a corrupt bucket stops it until a good push, and failures are named."""
import os

import pytest
import torch

from moeloop.errors import InputError
from moeloop.loop import rl
from moeloop.loop.components import build_components
from moeloop.loop.remote_rollout import RemoteEngine, RemoteRolloutError
from moeloop.model.factory import init_model
from moeloop.sync import WeightSyncError
from tests.test_rl_async import ASYNC, _rows, check_dp2_matches_dp1
from tests.test_rl_loop import _cfg, _metrics, _weights

APART = ("rollout.mode=disaggregated",)
SMALL = 16 << 10  # bytes per bucket where a test wants many


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return init_model("qwen3_moe", "tiny", tmp_path_factory.mktemp("model") / "m", seed=3)


def test_on_policy_equals_colocated(model_dir, tmp_path):
    """max_staleness=0: each batch generated in the engine process on the weights it trains, bit for bit what the
    colocated engine (sharing the actor's parameters) generates. Buckets of 16 KiB: dozens a push, so the two lent
    buffers are packed again while the engine process reads them in turn."""
    rl.run_rl(_cfg(model_dir, tmp_path / "apart", *APART, "rollout.max_staleness=0", f"sync.bucket_bytes={SMALL}"))
    rl.run_rl(_cfg(model_dir, tmp_path / "col"))
    assert _metrics(tmp_path / "apart") == _metrics(tmp_path / "col")
    assert [r["policy/sample_lag"] for r in _rows(tmp_path / "apart")] == [0, 0, 0, 0]
    assert all(r["sync/bytes"] > 20 * SMALL for r in _rows(tmp_path / "apart"))  # flat buckets crossed over
    wa, wc = _weights(tmp_path / "apart"), _weights(tmp_path / "col")
    for name in wa:
        assert torch.equal(wa[name], wc[name]), name


def test_ahead_equals_async(model_dir, tmp_path):
    """max_staleness=1: the next batch generated in the engine process while this one trains; the same batches,
    one version old, as the in-process rollout thread's."""
    rl.run_rl(_cfg(model_dir, tmp_path / "apart", *APART, "rollout.max_staleness=1"))
    rl.run_rl(_cfg(model_dir, tmp_path / "thread", *ASYNC))
    rows = _rows(tmp_path / "apart")
    assert [r["policy/sample_lag"] for r in rows] == [0, 1, 1, 1]
    assert all("time/gen_beside" in r for r in rows[1:])
    assert _metrics(tmp_path / "apart") == _metrics(tmp_path / "thread")
    wa, wt = _weights(tmp_path / "apart"), _weights(tmp_path / "thread")
    for name in wa:
        assert torch.equal(wa[name], wt[name]), name


def test_resume_equals_straight_run(model_dir, tmp_path):
    """Generated ahead, with a checkpoint every 2 steps: nothing is generated across a checkpoint, so the resumed
    run (a new engine process, given the checkpoint's weights) repeats the straight one bit for bit."""
    ahead, every = (*APART, "rollout.max_staleness=1"), "checkpoint.save_every=2"
    rl.run_rl(_cfg(model_dir, tmp_path / "a", *ahead, every))
    rl.run_rl(_cfg(model_dir, tmp_path / "b", *ahead, every, "trainer.steps=2"))
    rl.run_rl(_cfg(model_dir, tmp_path / "b", *ahead, every), resume=True)
    assert _metrics(tmp_path / "a") == _metrics(tmp_path / "b")
    wa, wb = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_dp2_matches_dp1(model_dir, tmp_path):
    """Each rank with an engine process of its own."""
    check_dp2_matches_dp1(model_dir, tmp_path, (*APART, "rollout.max_staleness=1"))


def _version_of_next_sample(c) -> int:
    examples, positions = c.next_prompts(1)
    return c.rollout.generate(examples, c.train_params(0, 0, positions), 0)[0].policy_version


def _push_through(c, change, version: int) -> None:
    """A push whose buckets pass through `change` on their way (after the transport); the transport as it was after."""
    transfer = c.syncer.transport.transfer

    def changed(buckets):
        for bucket in transfer(buckets):
            yield change(bucket)
    c.syncer.transport.transfer = changed
    try:
        c.syncer.push(c.actor.named_weights(), c.engine, version=version)
    finally:
        c.syncer.transport.transfer = transfer


def test_a_corrupt_bucket_is_refused_where_it_arrives(model_dir, tmp_path):
    c = build_components(_cfg(model_dir, tmp_path / "run", *APART), resume=False)
    try:
        assert isinstance(c.engine, RemoteEngine) and c.engine.proc.pid != os.getpid()
        c.syncer.push(c.actor.named_weights(), c.engine, version=1)
        assert _version_of_next_sample(c) == 1
        def corrupt(bucket):  # after the sender fingerprinted it: bytes that change on the way
            bucket.buffer = bucket.buffer.clone()
            bucket.buffer[7] ^= 0x5A
            return bucket
        with pytest.raises(WeightSyncError, match="failed its checksum"):
            _push_through(c, corrupt, version=2)
        assert c.engine.policy_version == 1
        c.engine.resume()  # the failed push left it paused, and it refuses to generate from a half-updated model
        with pytest.raises(RuntimeError, match="half-updated"):
            _version_of_next_sample(c)
        c.syncer.push(c.actor.named_weights(), c.engine, version=2)  # the pipe is in step again
        assert _version_of_next_sample(c) == 2
    finally:
        c.finish()
    assert not c.engine.proc.is_alive()


def test_a_push_that_fails_on_the_trainer_side_leaves_the_pipe_in_step(model_dir, tmp_path):
    """The stream breaks after a few of many small buckets (some acknowledged, the lent buffers reused): the push
    raises this side's error, the engine process refuses the incomplete set and keeps its version, and the next
    push goes through."""
    c = build_components(_cfg(model_dir, tmp_path / "run", *APART, f"sync.bucket_bytes={SMALL}"), resume=False)
    try:
        c.syncer.push(c.actor.named_weights(), c.engine, version=1)
        def breaks(bucket):
            if bucket.index == 5:
                raise OSError("the trainer lost its stream")
            return bucket
        with pytest.raises(OSError, match="lost its stream"):
            _push_through(c, breaks, version=2)
        assert c.engine.policy_version == 1
        c.syncer.push(c.actor.named_weights(), c.engine, version=2)
        assert _version_of_next_sample(c) == 2
    finally:
        c.finish()


def broken_reward(sample) -> float:
    raise ValueError("this reward always fails")


def test_a_failed_run_ends_its_engine_process(model_dir, tmp_path):
    import multiprocessing
    with pytest.raises(Exception, match="always fails"):
        rl.run_rl(_cfg(model_dir, tmp_path / "run", *APART, "reward.fn=tests.test_rl_disaggregated.broken_reward",
                       "reward.fallback=fail", "reward.retries=0"))
    assert not [p for p in multiprocessing.active_children() if p.name == "moeloop-rollout"]


def test_a_dead_engine_process_is_named(model_dir, tmp_path):
    c = build_components(_cfg(model_dir, tmp_path / "run", *APART), resume=False)
    try:
        c.engine.proc.kill()
        c.engine.proc.join()
        with pytest.raises(RemoteRolloutError, match="rollout process"):
            _version_of_next_sample(c)
    finally:
        c.finish()


@pytest.mark.parametrize("extra, field", [(("sync.transport=disk",), "sync.transport"),
                                          (("sync.transport=broadcast",), "sync.transport"),
                                          (("rollout.device=cuda:7",), "rollout.device"),
                                          (("rollout.max_staleness=1", "algorithm.dynamic_sampling=true"),
                                           "algorithm.dynamic_sampling"),
                                          (("rollout.device=tpu",), "rollout.device")])
def test_settings_it_cannot_run_are_named(model_dir, tmp_path, extra, field):
    with pytest.raises(InputError, match=field):
        rl.run_rl(_cfg(model_dir, tmp_path / "run", *APART, *extra))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_through_ipc(model_dir, tmp_path):
    """On CUDA the buckets cross as CUDA IPC handles; the engine process verifies them on its device (the second
    GPU when there is one, else the trainer's own)."""
    device = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    rl.run_rl(_cfg(model_dir, tmp_path / "run", *APART, "rollout.max_staleness=1", f"rollout.device={device}",
                   f"sync.bucket_bytes={SMALL}", device="cuda"))
    rows = _rows(tmp_path / "run")
    assert [r["policy/sample_lag"] for r in rows] == [0, 1, 1, 1]
    assert all(r["sync/bytes"] > 0 and torch.isfinite(torch.tensor(r["pg_loss"])) for r in rows)
