"""`moeloop generate` end to end on a tiny model folder written by the factory (model + tokenizer)."""
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from moeloop.cli import main as cli_main
from moeloop.model.factory import init_model


def test_generate_command_writes_completions(tmp_path, capsys):
    model_dir = init_model("qwen3_moe", "tiny", tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1="}) + "\n" +
                       json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "o.jsonl"
    rc = cli_main(["generate", str(model_dir), "--prompts", str(prompts), "--out", str(out), "--n", "2",
                   "--max-tokens", "5", "--temperature", "0.8", "--top-k", "10", "--seed", "3",
                   "--repetition-penalty", "1.2", "--min-p", "0.05"])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4 and rows[0]["prompt"] == "1+1=" and "hi" in rows[2]["prompt"]
    for r in rows:
        assert 1 <= len(r["response_token_ids"]) <= 5 and len(r["logprobs"]) == len(r["response_token_ids"])
        assert r["finish_reason"] in ("stop", "length") and isinstance(r["completion"], str)
    assert "tok/s" in capsys.readouterr().out


def test_generate_stops_at_stop_tokens_and_strings(tmp_path):
    """--stop-token-id ends a greedy sample at that token, --stop once its text holds the string (both kept, as the
    tokens that made them are): prefixes of the free run, finish_reason "stop"."""
    model_dir = init_model("qwen3_moe", "tiny", tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "12+34="}) + "\n")
    out = tmp_path / "o.jsonl"

    def run(*flags: str) -> dict:
        assert cli_main(["generate", str(model_dir), "--prompts", str(prompts), "--out", str(out), "--temperature",
                         "0", "--max-tokens", "12", "--ignore-eos", *flags]) == 0
        return json.loads(out.read_text().splitlines()[0])

    free = run()
    ids, text = free["response_token_ids"], free["completion"]
    assert len(ids) == 12 and free["finish_reason"] == "length"
    by_token = run("--stop-token-id", str(ids[3]))
    assert by_token["response_token_ids"] == ids[:ids.index(ids[3]) + 1] and by_token["finish_reason"] == "stop"
    stop = text[2:4]
    by_string = run("--stop", stop, "--stop", "never-seen")
    assert by_string["finish_reason"] == "stop" and stop in by_string["completion"]
    assert len(by_string["response_token_ids"]) < len(ids)
    assert ids[:len(by_string["response_token_ids"])] == by_string["response_token_ids"]
    assert text.startswith(by_string["completion"])


@pytest.mark.parametrize("line,message", [
    ('{"prompt": 3}', r"p.jsonl:2: 'prompt' must be a string, got int"),
    ("{not json", r"p.jsonl:2: not valid JSON"),
    ("[1, 2]", r"p.jsonl:2: a row must be a JSON object, got list"),
    ('{"text": "x"}', r"p.jsonl:2: needs a 'prompt' or 'messages' field"),
    ('{"messages": [{"role": "user"}]}', r"p.jsonl:2: 'messages': message 0 must be an object with string 'role'"),
    ('{"messages": []}', r"p.jsonl:2: 'messages': a prompt must be a string or a non-empty list"),
])
def test_generate_names_the_bad_line_and_writes_nothing(tmp_path, capsys, line, message):
    """A bad prompts line: exit code 2, one line on stderr naming the file, line and problem (no traceback), and no
    output file."""
    model_dir = init_model("qwen3_moe", "tiny", tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1="}) + "\n" + line + "\n")
    out = tmp_path / "o.jsonl"
    assert cli_main(["generate", str(model_dir), "--prompts", str(prompts), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.startswith("moeloop generate: ") and "Traceback" not in err
    assert not out.exists()


def test_generate_and_rl_report_bad_flags_files_and_fields(tmp_path, capsys):
    """Bad sampling flags, a missing prompts file, a prompt too long for --max-model-len, bad config fields, a
    missing config, a model.path with no model folder (transformers would take it for a hub id), a model folder with no
    tokenizer files, no chat template or a broken config.json, an unknown reward function and data with no answers:
    exit code 2 and the flag, file or field named on stderr."""
    model_dir = init_model("qwen3_moe", "tiny", tmp_path / "m")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1="}) + "\n")
    base = ["generate", str(model_dir), "--out", str(tmp_path / "o.jsonl")]
    cases = [(base + ["--prompts", str(prompts), "--top-p", "1.5"], r"SamplingParams.top_p must be in \(0, 1\]"),
             (base + ["--prompts", str(prompts), "--min-p", "1.5"], r"SamplingParams.min_p must be in \[0, 1\]"),
             (base + ["--prompts", str(prompts), "--repetition-penalty", "0"], "SamplingParams.repetition_penalty must"),
             (base + ["--prompts", str(prompts), "--stop", ""], "SamplingParams.stop: an empty stop string"),
             (base + ["--prompts", str(prompts), "--stop-token-id", "100000"], r"stop_token_ids must be in \[0, 128\)"),
             (base + ["--prompts", str(prompts), "--n", "0"], "SamplingParams.n must be >= 1"),
             (base + ["--prompts", str(tmp_path / "none.jsonl")], "prompts file not found: .*none.jsonl"),
             (["rl", "examples/tiny.yaml", "rollout.n=0"], "moeloop rl: rollout.n: must be >= 1"),
             (["rl", "examples/tiny.yaml", "rollout.n=zero"],  # (was "config in examples/tiny.yaml: rollout.n: ...")
              "moeloop rl: config override: rollout.n: Value 'zero' of type 'str' could not be converted to Integer"),
             (["rl", "examples/tiny.yaml", "trainer.log=console"],  # (was "AnyNode is not a ListConfig, ...")
              r"moeloop rl: config override: trainer.log: must be a list, e.g. trainer.log=\[console\]"),
             (["rl", str(tmp_path / "none.yaml")], "moeloop rl: config file not found: .*none.yaml"),
             (["rl", "examples/tiny.yaml", "trainer.device=gpu"], "moeloop rl: trainer.device: must be auto.cpu.cuda"),
             (["rl", "examples/tiny.yaml", "trainer.log=[consol]"], "moeloop rl: trainer.log: must list sinks from"),
             (["sft", "examples/tiny_sft.yaml", "trainer.steps=-1"], "moeloop sft: trainer.steps: must be >= 0"),
             (["rl", "examples/tiny.yaml", "checkpoint.keep=0"], "moeloop rl: checkpoint.keep: must be >= 1"),
             (["rl", "examples/tiny.yaml", "actor.optim.betas=[0.9]"],
              r"moeloop rl: actor.optim.betas: must be two values in \[0, 1\), got \[0.9\]"),
             (["rl", "examples/tiny.yaml", "data.val_batch_size=0"], "moeloop rl: data.val_batch_size: must be > 0"),
             (["rl", "examples/tiny.yaml", "trainer.val_every=0", "trainer.log_val_generations=4"],
              "moeloop rl: trainer.log_val_generations=4 needs trainer.val_every > 0"),
             (["rl", "examples/tiny.yaml", "model.path=runs/x/hf", "trainer.run_dir=runs/x"],
              r"moeloop rl: trainer.run_dir=runs/x: the run's HF export \(runs/x/hf\) would overwrite model.path"),
             (["rl", "examples/tiny.yaml", "data.train_max_samples=0"],
              r"moeloop rl: data.train_max_samples: must be -1 \(all\) or > 0"),
             (["rl", "examples/tiny.yaml", "data.val_max_samples=0"],
              r"moeloop rl: data.val_max_samples: must be -1 \(all\) or > 0"),
             (["rl", "examples/tiny.yaml", "data.val_files=[]"], "moeloop rl: trainer.val_every=100 needs held-out prompts"),
             (["rl", "examples/tiny.yaml", "actor.ppo_mini_batch_size=0"],  # ZeroDivisionError before
              "moeloop rl: actor.ppo_mini_batch_size: must be >= 1"),
             (["rl", "examples/tiny.yaml", "algorithm.gamma=2"], r"moeloop rl: algorithm.gamma: must be in \[0, 1\]"),
             (["plan", "examples/plan_seed002.yaml", "parallel.dp=0"], "moeloop plan: parallel.dp: must be >= 1"),
             (["plan", "examples/plan_seed002.yaml", "plan.dense_params=-1"], "moeloop plan: plan.dense_params: must be >= 0"),
             (["plan", "examples/plan_seed002.yaml", "hardware.gpus_per_node=0"],  # ZeroDivisionErrors before
              "moeloop plan: hardware.gpus_per_node: must be >= 1"),
             (["rl", "examples/tiny.yaml", "algorithm.overlong_penalty=true"],  # its buffer 16 > the 8 tokens
              r"moeloop rl: algorithm.overlong_buffer_len=16 must be in \(0, data.max_response_length=8\]"),
             (["sft", "examples/tiny_sft.yaml", f"model.path={tmp_path / 'none'}"],
              "moeloop sft: model.path=.*none: no model folder there"),
             (["reward", "serve", "--fn", "nope"], "moeloop reward: reward.fn='nope' is neither a built-in")]
    long_prompt = tmp_path / "long.jsonl"
    long_prompt.write_text(json.dumps({"prompt": "1+1="}) + "\n" + json.dumps({"prompt": "1+1=" * 20}) + "\n")
    cases.append((base + ["--prompts", str(long_prompt), "--max-model-len", "32", "--max-tokens", "4"],
                  r"long.jsonl:2: the prompt's \d+ tokens \+ --max-tokens 4 are more than --max-model-len 32"))
    cases.append((["rl", "examples/tiny.yaml", f"model.path={model_dir}", "rollout.kv_cache_bytes=1000"],
                  "moeloop rl: rollout.kv_cache_bytes: a KV budget of 1000 bytes holds 0 blocks"))
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "1+1="}]}) + "\n")
    for name, drop, message in (("no_tokenizer", ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"),
                                 "model_dir=.*no_tokenizer: its tokenizer has 1 token"),  # was: 'the prompt has no tokens'
                                ("no_template", ("chat_template.jinja",),
                                 r"chat.jsonl:1: 'messages' are rendered by the tokenizer's chat template, and this")):
        folder = tmp_path / name
        shutil.copytree(model_dir, folder)
        for f in drop:
            (folder / f).unlink()
        cases.append((["generate", str(folder), "--prompts", str(chat), "--out", str(tmp_path / "o.jsonl")], message))
    cases.append((base[:2] + ["--prompts", str(prompts), "--out", str(tmp_path / "none" / "o.jsonl")],
                  "moeloop generate: --out .*none/o.jsonl: .*none is not a writable directory"))  # (after generating)
    cases.append((["sft", "examples/tiny_sft.yaml", f"model.path={model_dir}", f"trainer.run_dir={prompts}/run"],
                  r"moeloop sft: trainer.run_dir=.*p.jsonl/run: cannot make the directory \(Not a directory\)"))
    cases.append((["init-model", "--arch", "qwen3_moe", "--out", str(prompts)],  # FileExistsError before
                  "moeloop init-model: --out .*p.jsonl: exists and is not a directory"))
    tool = tmp_path / "tool.jsonl"  # a role the tiny models' chat template refuses (a jinja2 TemplateError before)
    tool.write_text(json.dumps({"messages": [{"role": "function", "content": "1+1="}]}) + "\n")
    cases.append((base[:2] + ["--prompts", str(tool), "--out", str(tmp_path / "o.jsonl")],
                  "moeloop generate: .*tool.jsonl:1: the chat template refuses these messages: unknown chat role function"))
    cases.append((base[:2] + ["--prompts", str(prompts), "--out", str(prompts)],
                  "moeloop generate: --out .*p.jsonl: is the --prompts file"))
    cases.append((["ckpt", "export", str(tmp_path), "--model", str(model_dir), "--out", str(model_dir)],
                  "moeloop ckpt: --out .*: is the --model folder"))
    for folder, hint in (("run/hf", "the run directory's HF export is .*run/hf"),  # model.path = a run's directory
                         ("ckpt", ".*ckpt holds a training checkpoint: `moeloop ckpt export .*ckpt --model")):  # or checkpoint
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / ("config.json" if folder == "run/hf" else "meta.json")).write_text("{}")
        cases.append((["sft", "examples/tiny_sft.yaml", f"model.path={tmp_path / folder.split('/')[0]}"],
                      f"no model folder there .*; {hint}"))
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("actor: [\n")
    cases.append((["rl", str(bad_yaml)], "moeloop rl: config .*bad.yaml: not valid YAML"))
    list_yaml = tmp_path / "list.yaml"
    list_yaml.write_text("- model\n")  # (a TypeError from OmegaConf's merge before)
    cases.append((["rl", str(list_yaml)], "moeloop rl: config in .*list.yaml: must be a mapping of sections"))
    bad_config = tmp_path / "bad_config"
    shutil.copytree(model_dir, bad_config)
    (bad_config / "config.json").write_text("{")
    cases.append((["rl", "examples/tiny.yaml", f"model.path={bad_config}"], "moeloop rl: .*bad_config/config.json: not valid JSON"))
    no_answers = tmp_path / "no_answers.jsonl"
    no_answers.write_text(json.dumps({"prompt": "1+1="}) + "\n")  # the answer is under no data.answer_key
    cases.append((["rl", "examples/tiny.yaml", f"model.path={model_dir}", f"data.train_files=[{no_answers}]",
                   "data.val_files=[]", "trainer.val_every=0"],
                  "moeloop rl: data.answer_key='answer': no row of .*no_answers.jsonl has it, and reward.fn=arith"))
    cases.append((["rl", "examples/tiny.yaml", f"model.path={model_dir}", f"data.train_files=[{no_answers}]",
                   "data.val_files=[]", "trainer.val_every=0", "reward.fns=[{fn: format}, {fn: math, weight: 2}]"],
                  "moeloop rl: data.answer_key='answer': no row of .*no_answers.jsonl has it, and reward.fn=math"))
    cases.append((["rl", "examples/tiny.yaml", f"model.path={model_dir}", "reward.fn=my_rewards.compute_score",
                   f"trainer.run_dir={tmp_path / 'r'}"],
                  "moeloop rl: reward.fn='my_rewards.compute_score': cannot import module 'my_rewards'"))
    for setting, message in (("reward.fns=[{fn: arith, weigth: 0.1}]", r"reward.fns\[0\]: unknown keys \['weigth'\]"),
                             ("reward.fn_options={foo: 1}", r"reward.fn=arith takes no options, got \['foo'\]")):
        cases.append((["rl", "examples/tiny.yaml", f"model.path={model_dir}", setting, f"trainer.run_dir={tmp_path / 'r'}",
                       "trainer.steps=0", "trainer.val_every=0", "data.val_files=[]"], f"moeloop rl: {message}"))
    for argv, message in cases:
        assert cli_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert re.search(message, err) and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "r").exists()  # (the reward mistakes came after config.yaml; fn_options were dropped)


def test_the_moeloop_script_imports_user_code_from_the_working_directory(tmp_path, monkeypatch, capsys):
    """A verl compute_score in ./my_rewards.py: `moeloop rl` (a console script, whose sys.path has no working directory)
    imports it as `python -m moeloop rl` does; it failed with "cannot import module 'my_rewards'"."""
    (tmp_path / "my_rewards.py").write_text("def compute_score(data_source, solution_str, ground_truth):\n    return 1.0\n")
    config = Path("examples/tiny.yaml").resolve()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    assert cli_main(["rl", str(config), "reward.fn=my_rewards.compute_score", "model.path=none"]) == 2
    assert "model.path=none: no model folder there" in capsys.readouterr().err  # (past the reward.fn check)
    sys.modules.pop("my_rewards", None)


def test_rows_missing_some_answers_are_counted_on_stderr(capsys):
    """Their samples fall back one by one (silently before: the run logged only reward/fallen_back); none: nothing."""
    from moeloop.config import load_config
    from moeloop.data.dataset import Example
    from moeloop.loop.components import check_ground_truths

    class Rows(list):
        examples = property(list.copy)

    cfg = load_config("examples/tiny.yaml")
    check_ground_truths(cfg, "data.train_files", ["t.jsonl"], Rows([Example([1], "a", "2", ""), Example([1], "b", None, "")]))
    assert capsys.readouterr().err == ("data.train_files: 1 of 2 rows have no 'answer' (data.answer_key): reward.fn=arith "
                                       "fails on their samples, which fall back (reward.fallback=mask)\n")
    check_ground_truths(cfg, "data.train_files", ["t.jsonl"], Rows([Example([1], "a", "2", "")]))
    assert capsys.readouterr().err == ""


def test_sft_rl_and_plot_answer_help_and_refuse_unknown_options(capsys):
    """--help printed the usage (sft, rl: it was taken for the config file; plot: for the run directory), and an
    unknown option is named (it was read as a config override: "Key '--resum' not in 'RunConfig'")."""
    for name in ("sft", "rl", "plot"):
        assert cli_main([name, "--help"]) == 0 and capsys.readouterr().out.startswith(f"usage: moeloop {name} ")
    assert cli_main(["rl", "examples/tiny.yaml", "--resum"]) == 2
    assert capsys.readouterr().err.startswith("moeloop rl: unknown option --resum\nusage: moeloop rl CONFIG")


def test_demo_takes_zero_steps_and_refuses_negative_ones(monkeypatch, capsys):
    """--sft-steps 0 means no SFT (it ran the config's 400 steps), and a negative count is a usage error."""
    from moeloop.loop import demo
    taken = []
    monkeypatch.setattr(demo, "run_demo", lambda out, seed, sft_steps, rl_steps, task: taken.append(
        (str(out), sft_steps, rl_steps, task)))
    assert demo.main(["--sft-steps", "0", "--rl-steps", "1"]) == 0
    assert demo.main(["--task", "tools"]) == 0
    assert taken == [("runs/demo", 0, 1, "arith"), ("runs/tools", 300, 150, "tools")]
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--sft-steps", "-3"])
    assert exit_info.value.code == 2 and "argument --sft-steps: must be >= 0, got -3" in capsys.readouterr().err


def test_generate_refuses_a_device_it_cannot_use(tmp_path, capsys):
    """--device: cpu, cuda or cuda:N, and the CUDA device must be visible (an AssertionError or a RuntimeError from
    torch before)."""
    model_dir = init_model("qwen3_moe", "tiny", tmp_path / "m")
    visible = torch.cuda.device_count()
    for device, message in (("gpu", "must be cpu, cuda or cuda:N, got 'gpu'"),
                            (f"cuda:{visible}", f"cuda:{visible}: {visible} CUDA devices are visible")):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["generate", str(model_dir), "--prompts", "p.jsonl", "--out", "o.jsonl", "--device", device])
        assert exit_info.value.code == 2 and f"argument --device: {message}" in capsys.readouterr().err


def test_reward_serve_refuses_a_port_out_of_range(capsys):
    with pytest.raises(SystemExit) as exit_info:  # (an OverflowError from bind() before)
        cli_main(["reward", "serve", "--fn", "arith", "--port", "70000"])
    assert exit_info.value.code == 2 and "argument --port: must be in 0-65535, got 70000" in capsys.readouterr().err
