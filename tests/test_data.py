"""Data layer: JSONL and parquet rows, chat templates, the long-prompt policy, a resumable cursor,
and a held-out synthetic split disjoint from training."""
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moeloop.config.schema import DataSection
from moeloop.data import ArithTask, EpochCursor, PromptDataset, load_rows
from moeloop.errors import InputError
from moeloop.model.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_jsonl_and_parquet_give_the_same_examples(tmp_path, tokenizer):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": [{"role": "user", "content": "4+4="}], "answer": "8"}]
    jsonl = _write_jsonl(tmp_path / "d.jsonl", rows)
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+2=", "answer": "3"}]), tmp_path / "d.parquet")
    a = PromptDataset(load_rows([jsonl]), tokenizer, DataSection())
    b = PromptDataset(load_rows([str(tmp_path / "d.parquet")]), tokenizer, DataSection())
    assert a[0].prompt_ids == b[0].prompt_ids and a[0].ground_truth == "3"
    assert "<|user|>" in a[0].prompt_text and a[0].prompt_text.rstrip().endswith("<|assistant|>")
    assert "4+4=" in a[1].prompt_text


@pytest.mark.parametrize("policy", ["error", "left", "right", "drop"])
def test_long_prompt_policy(tmp_path, tokenizer, policy):
    path = _write_jsonl(tmp_path / "long.jsonl", [{"prompt": "x" * 100, "answer": "1"}, {"prompt": "1+1=", "answer": "2"}])
    cfg = DataSection(max_prompt_length=20, truncation=policy)
    if policy == "error":
        with pytest.raises(ValueError, match=r"long.jsonl:1: prompt has \d+ tokens > data.max_prompt_length=20"):
            PromptDataset(load_rows([path]), tokenizer, cfg)
        return
    ds = PromptDataset(load_rows([path]), tokenizer, cfg)
    if policy == "drop":
        assert len(ds) == 1 and ds.num_dropped == 1
    else:
        assert len(ds[0].prompt_ids) == 20 and len(ds) == 2
        full = tokenizer(ds.render_prompt("x" * 100), add_special_tokens=False)["input_ids"]
        assert ds[0].prompt_ids == (full[-20:] if policy == "left" else full[:20])


def test_bad_rows_name_the_file_and_line(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1="}\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        load_rows([str(bad)])
    with pytest.raises(ValueError, match="has no 'question'"):
        PromptDataset(load_rows([_write_jsonl(tmp_path / "q.jsonl", [{"prompt": "a"}])]), tokenizer,
                      DataSection(prompt_key="question"))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_rows([str(tmp_path / "missing.jsonl")])
    (tmp_path / "rows.json").write_text('[{"prompt": "a"}]\n')  # TRL users' JSON array (or a CSV): named as not JSONL
    with pytest.raises(InputError, match=r"rows.json:1: a row must be a JSON object, got list; data files are JSONL"):
        load_rows([str(tmp_path / "rows.json")])
    (tmp_path / "list.jsonl").write_text('{"prompt": "a"}\n["a"]\n')
    with pytest.raises(InputError, match="list.jsonl:2: a row must be a JSON object, got list"):
        load_rows([str(tmp_path / "list.jsonl")])
    for prompt, message in ((7, "a prompt must be a string or a non-empty list of chat messages, got int"),
                            ([], "a prompt must be a string or a non-empty list of chat messages, got an empty list"),
                            (" ", "the prompt is an empty or blank string"),  # (it trained on the chat template's tokens)
                            ([{"role": "user", "content": 3}], "message 0 must be an object with string 'role' and "
                                                               "'content'"),
                            ([{"role": "function", "content": "a"}], "the chat template refuses these messages: unknown "
                                                                 "chat role function")):
        with pytest.raises(InputError, match=f"p.jsonl:2: {re.escape(message)}"):
            PromptDataset(load_rows([_write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": prompt}])]),
                          tokenizer, DataSection())


def test_one_data_file_path_is_a_list_of_one():
    """verl's `data.train_files=x.parquet` (a string) on the command line or in YAML (it was an OmegaConf error)."""
    from moeloop.config import load_config
    cfg = load_config("examples/tiny.yaml", ["data.train_files=d/x.parquet", "data.val_files=[a.jsonl,b.jsonl]"])
    assert cfg.data.train_files == ["d/x.parquet"] and cfg.data.val_files == ["a.jsonl", "b.jsonl"]


def test_cursor_is_deterministic_and_resumable():
    straight = EpochCursor(10, seed=3)
    first = straight.take(7) + straight.take(7)  # crosses an epoch boundary
    resumed = EpochCursor(10, seed=3)
    resumed.take(7)
    state = resumed.state_dict()
    again = EpochCursor(10, seed=3)
    again.load_state_dict(state)
    assert first[7:] == again.take(7)
    assert sorted(first[:10]) == list(range(10))  # one epoch = a permutation
    with pytest.raises(ValueError, match="data cursor runs over 10 training rows, and data.train_files now give 11"):
        EpochCursor(11).load_state_dict(state)


def test_synthetic_splits_are_disjoint_and_verifiable():
    task = ArithTask(size=500)
    train, val = task.rows("train"), task.rows("val")
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    for r in train[:50]:
        a, b = r["prompt"].rstrip("=").split("+")
        assert int(r["answer"]) == int(a) + int(b)
