"""Rows from JSONL / parquet files (or the synthetic task) and their tokenization.

A row carries a prompt (`prompt_key`: a string, or a list of chat messages), a ground truth
(`answer_key`), optionally a `response` (SFT target) and a `data_source`. Prompts are rendered
through the tokenizer's chat template. Prompts longer than `max_prompt_length` follow
`data.truncation`: error (default, names file and row), left / right (cut), drop (skipped, counted).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeloop.config.schema import DataSection
from moeloop.data.synthetic import parse_synthetic_spec
from moeloop.errors import InputError


def load_rows(files: list[str], seed: int = 0) -> list[dict]:
    rows: list[dict] = []
    for spec in files:
        if spec.startswith("synthetic:"):
            task, split = parse_synthetic_spec(spec)
            rows += [dict(r, _source=f"{spec}#{i}") for i, r in enumerate(task.rows(split, seed))]
        else:
            rows += _read_file(Path(spec))
    return rows


def _read_file(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        return [dict(r, _source=f"{path}#{i}") for i, r in enumerate(pq.read_table(path).to_pylist())]
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        rows.append(dict(json_object(line, f"{path}:{i + 1}"), _source=f"{path}:{i + 1}"))
    return rows


def json_object(line: str, where: str) -> dict:
    """One JSONL line as an object; otherwise an InputError naming `where` (file:line)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise InputError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(row, dict):
        raise InputError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    return row


def chat_messages(prompt: Any, where: str) -> list[dict]:
    """A prompt field as chat messages: a string is one user message; a list must hold {"role": str, "content": str}
    objects. Anything else is an InputError naming `where` (file:line) and the problem."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise InputError(f"{where}: a prompt must be a string or a non-empty list of chat messages, "
                         f"got {type(prompt).__name__}")
    for i, m in enumerate(prompt):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise InputError(f"{where}: message {i} must be an object with string 'role' and 'content', got {m!r:.80}")
    return prompt


def render_chat(tokenizer: Any, messages: list[dict], where: str) -> str:
    """`messages` through the tokenizer's chat template, with the generation prompt; a template that refuses them
    (an unknown role, say) is an InputError naming `where` (file:line)."""
    from jinja2 import TemplateError  # (transformers renders chat templates with jinja2)

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as err:
        raise InputError(f"{where}: the chat template refuses these messages: {err}") from None


@dataclass
class Example:
    prompt_ids: list[int]
    prompt_text: str
    ground_truth: Any
    data_source: str
    response_ids: list[int] = field(default_factory=list)  # SFT target (ends with EOS)


class PromptDataset:
    """Tokenized rows; `examples[i]` is row i after the truncation policy."""

    def __init__(self, rows: list[dict], tokenizer: Any, cfg: DataSection, with_response: bool = False):
        self.tokenizer, self.cfg, self.with_response = tokenizer, cfg, with_response
        self.examples: list[Example] = []
        self.num_dropped = 0
        for row in rows:
            example = self._encode(row)
            if example is None:
                self.num_dropped += 1
            else:
                self.examples.append(example)
        if not self.examples:
            raise InputError(f"no usable rows in data files (dropped {self.num_dropped} over max_prompt_length)")

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]

    def render_prompt(self, prompt: str | list[dict], where: str = "prompt") -> str:
        messages = chat_messages(prompt, where)
        if self.cfg.apply_chat_template and getattr(self.tokenizer, "chat_template", None):
            return render_chat(self.tokenizer, messages, where)
        return "".join(m["content"] for m in messages)

    def _encode(self, row: dict) -> Example | None:
        where = row.get("_source", "?")
        if self.cfg.prompt_key not in row:
            raise InputError(f"{where}: row has no {self.cfg.prompt_key!r} (data.prompt_key)")
        text = self.render_prompt(row[self.cfg.prompt_key], where)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = self._truncate(ids, where)
        if ids is None:
            return None
        example = Example(ids, text, row.get(self.cfg.answer_key), row.get("data_source", "") or "")
        if self.with_response:
            if "response" not in row:
                raise InputError(f"{where}: SFT row has no 'response'")
            resp = self.tokenizer(str(row["response"]), add_special_tokens=False)["input_ids"]
            example.response_ids = resp[: self.cfg.max_response_length - 1] + [self.tokenizer.eos_token_id]
        return example

    def _truncate(self, ids: list[int], where: str) -> list[int] | None:
        limit, policy = self.cfg.max_prompt_length, self.cfg.truncation
        if len(ids) <= limit:
            return ids
        if policy == "error":
            raise InputError(f"{where}: prompt has {len(ids)} tokens > data.max_prompt_length={limit} "
                             f"(set data.truncation to left, right or drop)")
        if policy == "drop":
            return None
        return ids[-limit:] if policy == "left" else ids[:limit]
