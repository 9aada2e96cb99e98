"""reward.fn=reward_model: a transformers sequence classifier as the reward, against the same model called directly
(one unpadded text at a time) — batched in the reward pool, over HTTP in the reward service, and in an RL run."""
import asyncio
import json

import pytest
import torch

from moeloop.errors import InputError
from moeloop.model.tokenizer import build_tokenizer
from moeloop.reward.pool import RewardPool
from moeloop.reward.registry import get_reward_fn
from moeloop.types import Sample


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    """A tiny random Llama reward model (one output) with the project's tokenizer and chat template. (Not Qwen2:
    transformers 5 loads a qwen2 folder's tokenizer as Qwen2Tokenizer, whose pre-tokenizer drops this vocabulary's
    newline token.)"""
    from transformers import LlamaConfig, LlamaForSequenceClassification
    out = tmp_path_factory.mktemp("rm")
    tokenizer = build_tokenizer(out)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(out)
    return out


def _direct(rm_dir, texts):
    """Each text's score from the model called on it alone (no padding, no batching)."""
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tokenizer = build_tokenizer()
    with torch.no_grad():
        return [float(model(torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"]])).logits[0, 0])
                for t in texts]


def _samples(count):
    return [Sample(prompt_ids=[1], prompt_text=f"<bos><|user|>{i}+{i}=\n<|assistant|>", response_text=str(7 * i + 1) * (i % 4 + 1),
                   metadata={"messages": [{"role": "user", "content": f"{i}+{i}="}]}) for i in range(count)]


def test_the_reward_pool_batches_the_calls_and_scores_as_the_model_does(rm_dir):
    """20 samples at concurrency 8: a handful of padded forwards, each score the model's on that text alone (padding
    and batching change nothing beyond fp32 noise). The text is the messages and the response through the reward
    model's chat template."""
    fn = get_reward_fn("reward_model", path=str(rm_dir))
    samples = _samples(20)
    texts = [fn.text(s) for s in samples]
    assert texts[3] == "<bos><|user|>3+3=\n<|assistant|>22222222<eos>"
    pool = RewardPool(fn, concurrency=8, fallback="fail")
    try:
        pool.score(samples)
    finally:
        pool.close()
    assert [s.reward for s in samples] == pytest.approx(_direct(rm_dir, texts), abs=1e-5)
    assert len({round(s.reward, 6) for s in samples}) > 10  # the scores differ: a constant would pass the above
    assert 3 <= fn.num_forwards <= 6, fn.num_forwards


def test_the_reward_service_serves_a_reward_model(rm_dir):
    """`moeloop reward serve --fn reward_model --fn-options '{"path": ...}'`: the options reach the model, and /score
    answers with its scores."""
    from aiohttp.test_utils import TestClient, TestServer

    from moeloop.reward.service import RewardService, _parse
    from moeloop.reward.wire import sample_to_json
    args = _parse(["serve", "--fn", "reward_model", "--fn-options", json.dumps({"path": str(rm_dir)})])
    fn = get_reward_fn(args.fn, **args.fn_options)
    samples = _samples(5)

    async def ask():
        async with TestClient(TestServer(RewardService(fn, "reward_model").app())) as client:
            response = await client.post("/score", json={"samples": [sample_to_json(s) for s in samples]})
            return [r["score"] for r in (await response.json())["results"]]
    assert asyncio.run(ask()) == pytest.approx(_direct(rm_dir, [fn.text(s) for s in samples]), abs=1e-5)
    assert fn.num_forwards == 1
    for bad in ("{", "[1]"):
        with pytest.raises(SystemExit):
            _parse(["serve", "--fn", "reward_model", "--fn-options", bad])


def test_an_rl_run_scores_its_samples_with_the_reward_model(rm_dir, tmp_path):
    """reward.fn=reward_model in the loop: each dumped sample's score is the model's on its messages + response, and
    the validation logs the mean score (reward/val)."""
    from moeloop.config import load_config
    from moeloop.loop.rl import run_rl
    from moeloop.model.factory import init_model
    model_dir = init_model("qwen3_moe", "tiny", tmp_path / "policy", seed=1)
    cfg = load_config(None, [
        "trainer.device=cpu", f"model.path={model_dir}", f"trainer.run_dir={tmp_path / 'run'}", "trainer.steps=1",
        "trainer.log=[jsonl]", "data.train_files=[synthetic:arith]", "data.max_prompt_length=64",
        "data.max_response_length=4", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
        "reward.fn=reward_model", f"reward.fn_options.path={rm_dir}", "reward.fallback=fail", "reward.concurrency=16",
        f"trainer.rollout_data_dir={tmp_path / 'dump'}", "checkpoint.save_final=false", "checkpoint.export_hf_final=false",
        "data.val_files=[synthetic:arith-val]", "data.val_max_samples=3", "trainer.val_every=1", "trainer.val_samples=0",
        "trainer.log_val_generations=3"])
    run_rl(cfg)
    val = [json.loads(line) for line in (tmp_path / "run" / "val.jsonl").read_text().splitlines()][-1]
    greedy = [json.loads(line) for line in (tmp_path / "run" / "val_generations.jsonl").read_text().splitlines()][-3:]
    assert val["reward/val"] == pytest.approx(sum(g["score"] for g in greedy) / 3)  # the mean score, not a count
    rows = [json.loads(line) for line in (tmp_path / "dump" / "1.jsonl").read_text().splitlines()]
    tokenizer = build_tokenizer()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"].split("<|user|>")[1].split("\n")[0]},
                                            {"role": "assistant", "content": r["response"]}], tokenize=False) for r in rows]
    assert len(rows) == 8 and [r["score"] for r in rows] == pytest.approx(_direct(rm_dir, texts), abs=1e-5)


def test_reward_model_options_are_checked(rm_dir, tmp_path):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification
    with pytest.raises(InputError, match=r"reward.fn_options: devices unknown to reward.fn=reward_model"):
        get_reward_fn("reward_model", path=str(rm_dir), devices="cpu")
    with pytest.raises(InputError, match=r"reward.fn_options.path='.*nowhere': not a model folder"):
        get_reward_fn("reward_model", path=str(tmp_path / "nowhere"))
    with pytest.raises(InputError, match=r"reward.fn_options.dtype='fp8': must be"):
        get_reward_fn("reward_model", path=str(rm_dir), dtype="fp8")
    two = tmp_path / "two"
    build_tokenizer(two)
    Qwen2ForSequenceClassification(Qwen2Config(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                               num_attention_heads=4, num_key_value_heads=2, num_labels=2)).save_pretrained(two)
    with pytest.raises(InputError, match="a reward model has one output .num_labels=1., this one has 2"):
        get_reward_fn("reward_model", path=str(two))


def test_a_supervised_local_service_serves_the_reward_model(rm_dir, monkeypatch):
    """reward.server.serve_fn=reward_model: the supervisor starts `moeloop reward serve` with reward.fn_options, and
    the pool scores through it over HTTP as the model does."""
    import os
    from pathlib import Path

    from moeloop.config.schema import RewardSection, RewardServerSection
    repo = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("PYTHONPATH", f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    section = RewardSection(fn="http", fn_options={"path": str(rm_dir)}, fallback="fail",
                            server=RewardServerSection(serve_fn="reward_model"))
    samples = _samples(6)
    with RewardPool.from_config(section) as pool:
        pool.score(samples)
    fn = get_reward_fn("reward_model", path=str(rm_dir))
    assert [s.reward for s in samples] == pytest.approx(_direct(rm_dir, [fn.text(s) for s in samples]), abs=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_reward_model_on_cuda_in_bf16_scores_as_on_the_cpu(rm_dir):
    """device=cuda, dtype=bfloat16: the batched scores within bf16's rounding of the fp32 CPU model's."""
    fn = get_reward_fn("reward_model", path=str(rm_dir), device="cuda", dtype="bfloat16")
    samples = _samples(12)
    pool = RewardPool(fn, concurrency=12, fallback="fail")
    try:
        pool.score(samples)
    finally:
        pool.close()
    expected = _direct(rm_dir, [fn.text(s) for s in samples])
    assert [s.reward for s in samples] == pytest.approx(expected, abs=5e-3)
    assert fn.num_forwards <= 2
