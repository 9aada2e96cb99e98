"""Rows from JSONL / parquet files (or the synthetic task) and their tokenization.

A row carries a prompt (`prompt_key`: a string, or a list of chat messages), a ground truth
(`answer_key`; a dotted key reads a nested field, as "reward_model.ground_truth" in verl's parquet files),
optionally a `data_source` and an `extra_info` (passed to the reward function), and for SFT a target in one
of TRL's dataset formats:
  - `response_key` a string: the prompt is rendered with the generation prompt, the target is the string's
    tokens and EOS;
  - `response_key` a list of assistant messages (conversational prompt-completion): the whole conversation
    is rendered and the loss covers those turns;
  - no `response_key`, and prompt messages with assistant turns (conversational language modelling, verl's
    multi-turn SFT): the loss covers every assistant turn, and the turns between them are context.
Prompts are rendered through the tokenizer's chat template. Prompts longer than `max_prompt_length`, and
SFT targets longer than `max_response_length`, follow `data.truncation`: error (default, names file and
row), left / right (a prompt is cut on that side, a target at its end, with no EOS added: the model is not
taught to stop where the cut fell), drop (skipped, counted).
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moeloop.config.schema import DataSection
from moeloop.data.synthetic import parse_synthetic_spec
from moeloop.errors import InputError


def load_rows(files: list[str], seed: int = 0, limit: int = -1) -> list[dict]:
    """The rows of `files` in order; the first `limit` of them (-1: all; data.train_max_samples, val_max_samples)."""
    rows: list[dict] = []
    for spec in files:
        if 0 <= limit <= len(rows):
            break
        if spec.startswith("synthetic:"):
            task, split = parse_synthetic_spec(spec)
            rows += [dict(r, _source=f"{spec}#{i}") for i, r in enumerate(task.rows(split, seed))]
        else:
            rows += _read_file(Path(spec))
    return rows if limit < 0 else rows[:limit]


def _read_file(path: Path) -> list[dict]:
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq
        return [dict(r, _source=f"{path}#{i}") for i, r in enumerate(pq.read_table(path).to_pylist())]
    rows: list[dict] = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rows.append(dict(json_object(line, f"{path}:{i + 1}"), _source=f"{path}:{i + 1}"))
        except InputError as err:  # the first row: maybe not JSONL at all (a JSON array, a CSV file)
            raise InputError(str(err) + ("" if rows else "; data files are JSONL (one JSON object a line) or "
                                         ".parquet")) from None
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


def nested_field(row: dict, key: str) -> Any:
    """`row[key]`; where the row has no such key, a dotted key walks nested objects ("reward_model.ground_truth").
    None when absent."""
    if key in row or "." not in key:
        return row.get(key)
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def chat_messages(prompt: Any, where: str) -> list[dict]:
    """A prompt field as chat messages: a string is one user message; a list must hold {"role": str, "content": str}
    objects. Anything else (an empty or blank string too) is an InputError naming `where` (file:line) and the problem."""
    if isinstance(prompt, str) and not prompt.strip():  # (it trained on the template's tokens alone, or failed mid-run)
        raise InputError(f"{where}: the prompt is an empty or blank string")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise InputError(f"{where}: a prompt must be a string or a non-empty list of chat messages, "
                         f"got {'an empty list' if prompt == [] else type(prompt).__name__}")
    for i, m in enumerate(prompt):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise InputError(f"{where}: message {i} must be an object with string 'role' and 'content', got {m!r:.80}")
    return prompt


def render_chat(tokenizer: Any, messages: list[dict], where: str, add_generation_prompt: bool = True,
                tools: list[dict] | None = None) -> str:
    """`messages` through the tokenizer's chat template (by default with the generation prompt; `tools`: the JSON
    schemas of the tools the model may call, for templates that list them); a template that refuses them (an unknown
    role, say) is an InputError naming `where` (file:line)."""
    from jinja2 import TemplateError  # (transformers renders chat templates with jinja2)

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             tools=tools)
    except TemplateError as err:
        raise InputError(f"{where}: the chat template refuses these messages: {err}") from None


def conversation_pieces(tokenizer: Any, messages: list[dict], learn_from: int, where: str,
                        tools: list[dict] | None = None) -> list[tuple[str, bool]]:
    """The chat template's text of `messages` up to their last learned turn, as (text, learned) pieces: each
    assistant message at index >= `learn_from` is learned, from after its header (the generation prompt) through
    the template's end of turn; everything before it is context. The template must render a conversation's first
    turns as a prefix of the whole (most do; Qwen3's drops the reasoning of earlier turns, for one): otherwise an
    InputError naming `where`. `tools`: the tool schemas the template lists (`render_chat`)."""
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < learn_from:
            continue
        head = render_chat(tokenizer, messages[:i], where, tools=tools)
        turn = render_chat(tokenizer, messages[:i + 1], where, add_generation_prompt=False, tools=tools)
        if not (head.startswith(done) and turn.startswith(head)):
            raise InputError(f"{where}: the chat template does not render message {i} as a continuation of the "
                             f"messages before it, so its tokens cannot be told apart for the SFT loss")
        pieces += [(head[len(done):], False), (turn[len(head):], True)]
        done = turn
    return pieces


@dataclass
class Example:
    prompt_ids: list[int]
    prompt_text: str
    ground_truth: Any
    data_source: str
    response_ids: list[int] = field(default_factory=list)  # SFT target (ends with EOS or the template's end of turn)
    loss_mask: list[int] | None = None  # SFT: 1 on the response tokens learned (None: all of them)
    extra_info: Any = None  # the row's `extra_info` (verl's), for the reward function
    messages: list[dict] | None = None  # the prompt as chat messages (a reward model renders them its own way)


class PromptDataset:
    """Tokenized rows; `examples[i]` is row i after the truncation policy."""

    def __init__(self, rows: list[dict], tokenizer: Any, cfg: DataSection, with_response: bool = False,
                 tools: list[dict] | None = None):
        """`tools`: JSON schemas of the tools of a multi-turn rollout, which the chat template lists in each prompt."""
        self.tokenizer, self.cfg, self.with_response, self.tools = tokenizer, cfg, with_response, tools
        self.examples: list[Example] = []
        self.num_dropped = 0
        for row in rows:
            example = self._encode(row)
            if example is None:
                self.num_dropped += 1
            else:
                self.examples.append(example)
        if not self.examples:
            raise InputError(f"no usable rows in data files (dropped {self.num_dropped} over max_prompt_length "
                             f"or max_response_length)")

    def __len__(self) -> int:
        return len(self.examples)

    def note_dropped(self, field_name: str, is_main: bool = True) -> None:
        """On stderr, how many rows of `field_name`'s files data.truncation=drop skipped (none: nothing)."""
        if self.num_dropped and is_main:
            print(f"{field_name}: dropped {self.num_dropped} of {self.num_dropped + len(self)} rows longer than "
                  f"data.max_prompt_length or data.max_response_length (data.truncation=drop)", file=sys.stderr)

    def __getitem__(self, i: int) -> Example:
        return self.examples[i]

    def render_prompt(self, prompt: str | list[dict], where: str = "prompt") -> str:
        return self._render(chat_messages(prompt, where), where)

    def _render(self, messages: list[dict], where: str) -> str:
        if self.cfg.apply_chat_template and getattr(self.tokenizer, "chat_template", None):
            return render_chat(self.tokenizer, messages, where, tools=self.tools)
        return "".join(m["content"] for m in messages)

    def _encode(self, row: dict) -> Example | None:
        where = row.get("_source", "?")
        if self.cfg.prompt_key not in row:
            raise InputError(f"{where}: row has no {self.cfg.prompt_key!r} (data.prompt_key)")
        prompt = row[self.cfg.prompt_key]
        messages = chat_messages(prompt, where)
        response = row.get(self.cfg.response_key)
        if self.with_response and (isinstance(response, list) or response is None and isinstance(prompt, list)):
            text, ids, response_ids, loss_mask = self._conversation(messages, response, where)
        else:
            text = self._render(messages, where)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            response_ids, loss_mask = [], None
            if self.with_response:
                if response is None:
                    raise InputError(f"{where}: SFT row has no {self.cfg.response_key!r} (data.response_key)")
                if not isinstance(response, (str, int, float)):  # (a dict was trained on as its repr)
                    raise InputError(f"{where}: {self.cfg.response_key!r} (data.response_key) must be a string or a "
                                     f"list of assistant messages, got {type(response).__name__}")
                response_ids = self.tokenizer(str(response), add_special_tokens=False)["input_ids"]
                response_ids.append(self.tokenizer.eos_token_id)
        ids = self._truncate(ids, where)
        if ids is None or not self._fits(response_ids, where):
            return None
        limit = self.cfg.max_response_length
        response_ids, loss_mask = response_ids[:limit], loss_mask if loss_mask is None else loss_mask[:limit]
        return Example(ids, text, nested_field(row, self.cfg.answer_key), row.get("data_source", "") or "",
                       response_ids, loss_mask, row.get("extra_info"), messages)

    def _conversation(self, messages: list[dict], response: list | None,
                      where: str) -> tuple[str, list[int], list[int], list[int]]:
        """An SFT row in a conversational format (its prompt's `messages`): (prompt text, prompt ids, response ids,
        their loss mask). The prompt is the conversation up to the first learned turn's header; the response is the
        rest."""
        learn_from = 0
        if response is not None:
            learn_from = len(messages)
            messages = messages + chat_messages(response, f"{where} ({self.cfg.response_key})")
            if any(m["role"] not in ("assistant", "tool") for m in messages[learn_from:]) or \
                    messages[learn_from]["role"] != "assistant":
                raise InputError(f"{where}: {self.cfg.response_key!r} (data.response_key) must hold assistant "
                                 f"messages (and tool results between them: not learned), the first an assistant's")
        if not (self.cfg.apply_chat_template and getattr(self.tokenizer, "chat_template", None)):
            raise InputError(f"{where}: a conversational SFT row needs the tokenizer's chat template "
                             f"(data.apply_chat_template=true and a template in the model folder)")
        pieces = conversation_pieces(self.tokenizer, messages, learn_from, where, self.tools)
        if not pieces:
            raise InputError(f"{where}: SFT row has no {self.cfg.response_key!r} (data.response_key) and its "
                             f"messages have no assistant turn to learn from")
        prompt_ids = self.tokenizer(pieces[0][0], add_special_tokens=False)["input_ids"]
        response_ids: list[int] = []
        loss_mask: list[int] = []
        for text, learned in pieces[1:]:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            response_ids += ids
            loss_mask += [int(learned)] * len(ids)
        return pieces[0][0], prompt_ids, response_ids, loss_mask

    def _fits(self, response_ids: list[int], where: str) -> bool:
        """Whether an SFT target fits `max_response_length`: when not, an InputError (truncation=error), False
        (drop), or True (left / right: the caller cuts its end)."""
        limit, policy = self.cfg.max_response_length, self.cfg.truncation
        if len(response_ids) <= limit or policy in ("left", "right"):
            return True
        if policy == "error":
            raise InputError(f"{where}: SFT target has {len(response_ids)} tokens > data.max_response_length={limit} "
                             f"(set data.truncation to right or drop)")
        return False

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
