"""The SFT entrance end to end on a tiny model: it learns, its HF export is directly the RL input, a resumed run
equals the straight one, and `trainer.epochs` counts a partial last batch as a step."""
import json
import shutil

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
    """... and the run directory's config.yaml is the resolved config the run ran (it loads back equal)."""
    from moeloop.config import to_yaml
    cfg = _cfg(model_dir, tmp_path / "sft")
    run_sft(cfg)
    assert to_yaml(load_config(tmp_path / "sft" / "config.yaml")) == to_yaml(cfg)
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


def _conversations(path, num_rows=24):
    """Two-turn sums as chat conversations: the loss should cover both assistant answers and nothing else."""
    rows = []
    for i in range(num_rows):
        a, b, c = i % 7, i % 5, i % 3
        rows.append({"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)},
                                  {"role": "user", "content": f"+{c}="}, {"role": "assistant", "content": str(a + b + c)}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_rows_in_trl_formats_learn_their_assistant_turns(capsys):
    """A string response, assistant messages as the response, and a whole conversation: the loss mask covers exactly
    the learned assistant turns (content and the template's end of turn); the context between turns is not learned."""
    from moeloop.config.schema import DataSection
    from moeloop.data.dataset import PromptDataset
    from moeloop.errors import InputError
    from moeloop.model.tokenizer import build_tokenizer

    tok = build_tokenizer()
    user = [{"role": "system", "content": "sum"}, {"role": "user", "content": "1+2="}]
    rows = [{"prompt": "1+2=", "response": "3"},
            {"prompt": user, "response": [{"role": "assistant", "content": "3"}]},
            {"prompt": user + [{"role": "assistant", "content": "3"}, {"role": "user", "content": "+4="},
                               {"role": "assistant", "content": "7"}]}]
    data = PromptDataset([dict(r, _source=f"f:{i}") for i, r in enumerate(rows)], tok,
                         DataSection(max_prompt_length=64, max_response_length=64), with_response=True)

    def text(ids):
        return tok.decode(ids)
    (plain, completion, whole) = data.examples
    assert text(plain.prompt_ids) == "<bos><|user|>1+2=\n<|assistant|>" and text(plain.response_ids) == "3<eos>"
    assert plain.loss_mask is None
    assert text(completion.prompt_ids) == "<bos><|system|>sum\n<|user|>1+2=\n<|assistant|>"
    assert text(completion.response_ids) == "3<eos>" and completion.loss_mask == [1, 1]
    assert text(whole.prompt_ids) == text(completion.prompt_ids)
    assert text(whole.response_ids) == "3<eos><|user|>+4=\n<|assistant|>7<eos>"
    assert whole.loss_mask == [1, 1] + [0] * 6 + [1, 1]

    # a target over max_response_length: refused, cut at its end (no EOS added after the cut), or dropped
    long_rows = [dict(rows[2], _source="f:2"), {"prompt": "1+2=", "response": "12345", "_source": "f:3"}]
    with pytest.raises(InputError, match=r"f:2: SFT target has 10 tokens > data.max_response_length=5"):
        PromptDataset(long_rows, tok, DataSection(max_response_length=5), with_response=True)
    cut = PromptDataset(long_rows, tok, DataSection(max_response_length=5, truncation="right"), with_response=True)
    assert cut.examples[0].response_ids == whole.response_ids[:5] and cut.examples[0].loss_mask == [1, 1, 0, 0, 0]
    assert text(cut.examples[1].response_ids) == "12345" and cut.examples[1].loss_mask is None
    kept = PromptDataset(long_rows, tok, DataSection(max_response_length=6, truncation="drop"), with_response=True)
    assert len(kept) == 1 and kept.num_dropped == 1 and text(kept.examples[0].response_ids) == "12345<eos>"
    kept.note_dropped("data.train_files")
    assert "data.train_files: dropped 1 of 2 rows longer than" in capsys.readouterr().err

    def refused(row, match, template=None, **cfg):
        if template is not None:
            tok.chat_template = template
        try:
            with pytest.raises(InputError, match=match):
                PromptDataset([dict(row, _source="f:9")], tok, DataSection(**cfg), with_response=True)
        finally:
            tok.chat_template = build_tokenizer().chat_template
    refused({"prompt": user}, r"f:9: SFT row has no 'response' \(data.response_key\) and its messages have no assistant")
    refused({"prompt": "1+2="}, r"f:9: SFT row has no 'answer_text' \(data.response_key\)", response_key="answer_text")
    refused({"prompt": user, "response": [{"role": "user", "content": "x"}]}, r"must hold assistant messages \(and tool results between them")
    refused({"prompt": "1+2=", "response": {"role": "assistant", "content": "3"}},
            r"'response' \(data.response_key\) must be a string or a list of assistant messages, got dict")
    refused(rows[1], "needs the tokenizer's chat template", apply_chat_template=False)
    # a template that drops earlier assistant turns (as Qwen3's drops their reasoning) cannot be cut into turns
    forgetful = ("{%- for m in messages %}{%- if m['role'] != 'assistant' or loop.last %}"
                 "{{ '<|' ~ m['role'] ~ '|>' ~ m['content'] ~ '\\n' }}{%- endif %}{%- endfor %}"
                 "{%- if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
    refused(rows[2], "does not render message 4 as a continuation", template=forgetful)


def test_the_sft_loss_is_the_mean_over_learned_tokens_only(model_dir, tmp_path):
    """sft_eval and sft_step's loss of a conversation against a hand computation from the full sequence's logits:
    the mean negative logprob of the learned tokens, the context turn excluded."""
    from moeloop.config.schema import ActorSection, DataSection
    from moeloop.data.dataset import PromptDataset
    from moeloop.model.tokenizer import load_folder_tokenizer
    from moeloop.train.actor import Actor
    from moeloop.types import Sample

    model = load_pretrained(model_dir)
    rows = [json.loads(line) for line in _conversations(tmp_path / "c.jsonl", 3).read_text().splitlines()]
    data = PromptDataset([dict(r, _source=str(i)) for i, r in enumerate(rows)], load_folder_tokenizer(model_dir, "m"),
                         DataSection(prompt_key="messages", max_prompt_length=64), with_response=True)
    nll = count = 0.0
    with torch.no_grad():
        for e in data.examples:  # one sequence at a time, through the plain forward and the full logits
            ids = torch.tensor(e.prompt_ids + e.response_ids)
            logits = model.compute_logits(model.forward_packed(ids, [len(ids)]))
            logprobs = torch.log_softmax(logits.double(), -1)[:-1].gather(-1, ids[1:, None])[:, 0]
            learned = torch.tensor([0.0] * (len(e.prompt_ids) - 1) + [float(m) for m in e.loss_mask])
            assert 0 < learned.sum() < len(e.response_ids)
            nll -= float((logprobs * learned).sum())
            count += float(learned.sum())
    actor = Actor(load_pretrained(model_dir), ActorSection(), torch.device("cpu"), 64)
    samples = [Sample(prompt_ids=e.prompt_ids, response_ids=e.response_ids, loss_mask=e.loss_mask, group_id=i)
               for i, e in enumerate(data.examples)]
    evaluated = actor.sft_eval(samples)
    assert evaluated["val/num_loss_tokens"] == count
    assert evaluated["val/sft_loss"] == pytest.approx(nll / count, rel=1e-5)
    assert actor.sft_step(samples)["sft_loss"] == pytest.approx(nll / count, rel=1e-5)


def test_sft_validation_and_conversations_on_2_ranks_match_1_rank(model_dir, tmp_path):
    """Multi-turn conversations with held-out validation: val.jsonl has the held-out loss at step 0, every
    trainer.val_every steps and at the last step; 9 held-out rows (of 11: data.val_max_samples) split 5 / 4 over
    2 gloo ranks give 1 rank's losses (the sums are global); `moeloop plot` of an SFT run charts its losses."""
    from moeloop.loop.plot import plot_run
    from tests.dist import run_ranks
    train, val = _conversations(tmp_path / "train.jsonl"), _conversations(tmp_path / "val.jsonl", 11)
    extra = ("trainer.steps=5", "data.val_max_samples=9", "trainer.val_every=2", "data.prompt_key=messages", "data.max_response_length=16", f"data.train_files=[{train}]",
             f"data.val_files=[{val}]", "data.train_batch_size=8", "actor.ppo_mini_batch_size=8")
    _sft_rank(0, 1, model_dir, tmp_path / "one", *extra)
    run_ranks(_sft_rank, 2, model_dir, tmp_path / "two", *extra)
    rows = {r: [json.loads(line) for line in (tmp_path / r / "val.jsonl").read_text().splitlines()] for r in ("one", "two")}
    assert [row["step"] for row in rows["one"]] == [0, 2, 4, 5]
    # the learned tokens: each answer's characters and its end of turn
    learned = sum(len(m["content"]) + 1 for line in val.read_text().splitlines()[:9]
                  for m in json.loads(line)["messages"] if m["role"] == "assistant")
    assert all(row["val/num_loss_tokens"] == learned for row in rows["one"] + rows["two"])
    losses = [row["val/sft_loss"] for row in rows["one"]]
    assert losses[-1] < losses[0] - 0.5, losses
    assert [row["val/sft_loss"] for row in rows["two"]] == pytest.approx(losses, rel=1e-5)
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-5)
    assert [p.name for p in plot_run(tmp_path / "one")] == ["loss.png", "phases.png"]
    _sft_rank(0, 1, model_dir, tmp_path / "late", *extra, "trainer.val_before_train=false")
    assert [json.loads(line)["step"] for line in (tmp_path / "late" / "val.jsonl").read_text().splitlines()] == [2, 4, 5]


def test_a_fresh_run_in_the_data_directory_keeps_the_data(model_dir, tmp_path):
    """A fresh run restarts its own JSONL files only: with trainer.run_dir the folder of the training data, the
    data file survives (every *.jsonl there was deleted), and a second fresh run starts metrics.jsonl and
    TensorBoard's events anew."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    data = _conversations(tmp_path / "rows.jsonl")
    before = data.read_text()
    for _ in range(2):
        run_sft(_cfg(model_dir, tmp_path, f"data.train_files=[{data}]", "data.prompt_key=messages",
                     "data.max_response_length=16", "trainer.steps=2", "data.train_batch_size=8",
                     "actor.ppo_mini_batch_size=8", "trainer.log=[jsonl,tensorboard]"))
        assert data.read_text() == before
    assert len(_losses(tmp_path)) == 2
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("sft_loss")] == [1, 2]


def test_a_resumed_run_replaces_the_rows_logged_after_its_checkpoint(model_dir, tmp_path):
    """A run stopped after step 5 with its newest checkpoint at step 4 logged step 5 once already: resumed, its
    metrics.jsonl and TensorBoard hold each step once, and equal the straight run's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    extra = ("trainer.log=[jsonl,tensorboard]", "checkpoint.save_every=2", "checkpoint.keep=5")
    run_sft(_cfg(model_dir, tmp_path / "straight", *extra))
    run_sft(_cfg(model_dir, tmp_path / "stopped", *extra, "trainer.steps=5"))
    checkpoints = tmp_path / "stopped" / "checkpoints"
    shutil.rmtree(checkpoints / "step_000005")
    (checkpoints / "latest").write_text("step_000004")
    run_sft(_cfg(model_dir, tmp_path / "stopped", *extra), resume=True)
    rows = [json.loads(line) for line in (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert _losses(tmp_path / "stopped") == _losses(tmp_path / "straight")
    events = EventAccumulator(str(tmp_path / "stopped" / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("sft_loss")] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in events.Scalars("sft_loss")] == pytest.approx(_losses(tmp_path / "straight"), rel=1e-6)


def test_a_failed_sft_run_closes_its_logger(model_dir, tmp_path, monkeypatch):
    """An exception (or Ctrl-C) in the middle of `moeloop sft` still closes the metrics logger (its progress bar and
    TensorBoard writer), before the exception goes on."""
    from moeloop.loop.metrics import MetricsLogger
    from moeloop.train.actor import Actor
    closed, step = [], Actor.sft_step

    def second_fails(self, samples):
        if closed == [] and getattr(self, "_calls", 0) == 1:
            raise KeyboardInterrupt
        self._calls = getattr(self, "_calls", 0) + 1
        return step(self, samples)

    monkeypatch.setattr(Actor, "sft_step", second_fails)
    monkeypatch.setattr(MetricsLogger, "close", lambda self: closed.append(True))
    with pytest.raises(KeyboardInterrupt):
        run_sft(_cfg(model_dir, tmp_path / "run"))
    assert closed == [True]
