"""Tools of multi-turn rollouts: reading an assistant turn's tool calls, running them, and the tool turn's tokens.

    calls = parse_hermes(text)                    # [ToolCall]; a malformed call is one with `.error` set
    runner = ToolRunner.from_config(cfg.rollout.multi_turn)
    results = runner.run(calls)                   # one ToolResult per call; a failure is an error text, never a raise
    ids = ToolTurn(tokenizer).ids([r.text for r in results], closes_turn=True)

A tool is a function `fn(**arguments) -> str` (or async), named by a dotted path in rollout.multi_turn.tools, or
a built-in (`calculator`). What it returns (or the error it raised, or its timing out) goes back to the model as
text: a tool never ends the run.
"""
from __future__ import annotations

import ast
import asyncio
import inspect
import json
import math
import operator
import re
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from moeloop.errors import InputError
from moeloop.reward.registry import import_by_path


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # the call could not be read: its result is this message


@dataclass
class ToolResult:
    text: str
    status: str  # ok | error | timeout | unknown_tool | parse_error


_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    """The `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of an assistant turn (Qwen's and Hermes'
    format); `arguments` may also be a JSON string of the object. A block that does not read is a call with `error`."""
    return [_read_call(body.strip()) for body in _HERMES.findall(text)]


def _read_call(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError as err:
        return ToolCall("", error=f"error: the tool call is not valid JSON ({err.msg} at {err.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
        return ToolCall("", error='error: a tool call is {"name": string, "arguments": object}')
    return ToolCall(obj["name"], args)


_OPS: dict[type, Callable] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                              ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
                              ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """The value of an arithmetic expression: numbers, + - * / // % and parentheses (no names, no powers).

    Args:
        expression: the expression, e.g. "12*(3+4)"
    """
    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"calculator: {ast.unparse(node)!r} is not arithmetic")
    if len(expression) > 200:
        raise ValueError("calculator: the expression is longer than 200 characters")
    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result) if isinstance(result, float) and result.is_integer() else result)


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}


def load_tools(names: list[str]) -> dict[str, Callable[..., Any]]:
    """name -> function of each rollout.multi_turn.tools entry (a built-in, or a dotted path: named by its last part)."""
    tools = {}
    for name in names:
        fn = BUILTIN_TOOLS.get(name) or import_by_path(name, "rollout.multi_turn.tools", BUILTIN_TOOLS)
        if not callable(fn):
            raise InputError(f"rollout.multi_turn.tools: {name!r} is not callable")
        tools[name.rpartition(".")[2]] = fn
    return tools


def tool_schemas(tools: dict[str, Callable[..., Any]]) -> list[dict]:
    """The JSON schema of each tool (transformers' `get_json_schema`: from its type hints and Google-style docstring),
    which chat templates that know tools list in the prompt, as TRL's and verl's do."""
    from transformers.utils import get_json_schema

    schemas = []
    for name, fn in tools.items():
        try:
            schemas.append(get_json_schema(fn))
        except Exception as err:
            raise InputError(f"rollout.multi_turn.tools: {name}: no schema for the prompt's tool list ({err}); a tool "
                             f"needs type hints and a docstring with an Args: section") from None
    return schemas


def prompt_tools(multi_turn: Any) -> list[dict] | None:
    """The tool schemas the prompts list (`tool_schemas`) when rollout.multi_turn is on, else None: RL's prompts and
    an SFT run's (with the same rollout.multi_turn section) then read alike."""
    return tool_schemas(load_tools(list(multi_turn.tools))) if multi_turn.enabled else None


def load_parser(name: str) -> Callable[[str], list[ToolCall]]:
    """rollout.multi_turn.parser: the built-in `parse_hermes`, or a user's `parse(text) -> [ToolCall]` (dotted path),
    guarded: a text it raises on is one unreadable call (its error text goes back to the model, the run goes on; a
    warning names the parser once); a result that is not a list of ToolCall is an InputError naming the field."""
    if name == "hermes":
        return parse_hermes
    parse, warned = import_by_path(name, "rollout.multi_turn.parser", ["hermes"]), []

    def guarded(text: str) -> list[ToolCall]:
        try:
            calls = parse(text)
        except Exception as err:
            if not warned:
                warned.append(True)
                warnings.warn(f"rollout.multi_turn.parser {name} raised {type(err).__name__}: {err}; the turn's tool "
                              "call is answered with that error (warned once)")
            return [ToolCall("", error=f"error: the tool call could not be read ({type(err).__name__}: {err})")]
        if not isinstance(calls, list) or not all(isinstance(c, ToolCall) for c in calls):
            raise InputError(f"rollout.multi_turn.parser: {name} returned {type(calls).__name__}, not a list of "
                             "moeloop.loop.tools.ToolCall")
        return calls

    return guarded


class ToolRunner:
    """Runs tool calls on a thread pool made once, `concurrency` at once. A call gets `timeout_s` from when it starts,
    and no call of a batch waits past timeout_s x ceil(calls / concurrency) from the batch's start (the time it takes
    when every call runs its whole timeout), so hung tools cost a batch that bound, not their sum. A timed-out call
    cannot be interrupted: it keeps its thread until it returns."""

    def __init__(self, tools: dict[str, Callable[..., Any]], timeout_s: float = 10.0, concurrency: int = 8):
        self.tools, self.timeout_s, self.concurrency = tools, timeout_s, concurrency
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="moeloop-tool")

    @classmethod
    def from_config(cls, cfg: Any) -> "ToolRunner":
        return cls(load_tools(list(cfg.tools)), cfg.timeout_s, cfg.concurrency)

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        started: dict[int, float] = {}  # call index -> when its thread took it
        futures = [None if c.error or c.name not in self.tools else self.pool.submit(self._call, c, started, i)
                   for i, c in enumerate(calls)]
        last = time.monotonic() + self.timeout_s * math.ceil(len(calls) / self.concurrency)
        return [self._result(c, f, lambda i=i: min(last, started.get(i, last - self.timeout_s) + self.timeout_s))
                for i, (c, f) in enumerate(zip(calls, futures))]

    def _call(self, call: ToolCall, started: dict[int, float], index: int) -> str:
        started[index] = time.monotonic()
        fn = self.tools[call.name]
        out = asyncio.run(fn(**call.arguments)) if inspect.iscoroutinefunction(fn) else fn(**call.arguments)
        return out if isinstance(out, str) else json.dumps(out)

    def _result(self, call: ToolCall, future: Any, deadline: Callable[[], float]) -> ToolResult:
        """The call's result, waiting for it until `deadline()` (read when the wait starts: by then the call has
        usually started, and its own timeout counts from then)."""
        if call.error:
            return ToolResult(call.error, "parse_error")
        if future is None:
            return ToolResult(f"error: no tool named {call.name!r} (tools: {', '.join(self.tools)})", "unknown_tool")
        try:
            return ToolResult(future.result(timeout=max(0.0, deadline() - time.monotonic())), "ok")
        except FutureTimeout:
            return ToolResult(f"error: {call.name} did not answer within {self.timeout_s:g} s", "timeout")
        except Exception as err:  # a tool's failure is the model's to read, not the run's to die of
            return ToolResult(f"error: {call.name} raised {type(err).__name__}: {err}", "error")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


_ANCHOR = "\x1fmoeloop-turn-end\x1f"


class ToolTurn:
    """The tokens that follow an assistant turn when tools answered it: the end of that turn (its EOS, when the model
    did not write it), one `tool` message per result, and the next assistant turn's header — the difference of the
    tokenizer's chat template with and without them, so any template that knows the `tool` role works."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.eos_text = tokenizer.decode([tokenizer.eos_token_id]) if tokenizer.eos_token_id is not None else ""
        self.ids(["x"], True)  # a template without the tool role fails here, at build, naming the tokenizer

    def ids(self, results: list[str], closes_turn: bool) -> list[int]:
        """Token ids of the tool turn; `closes_turn`: the assistant turn ended with EOS (else the ids start with it)."""
        base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _ANCHOR}]
        try:
            text = self.tokenizer.apply_chat_template(base + [{"role": "tool", "content": r} for r in results],
                                                      tokenize=False, add_generation_prompt=True)
        except Exception as err:
            raise InputError(f"rollout.multi_turn: the tokenizer's chat template cannot render a tool message: {err}") from None
        if text.count(_ANCHOR) != 1:
            raise InputError("rollout.multi_turn: the tokenizer's chat template does not keep the assistant's text as it is")
        rest = text[text.index(_ANCHOR) + len(_ANCHOR):]
        if closes_turn and self.eos_text and rest.startswith(self.eos_text):
            rest = rest[len(self.eos_text):]
        return self.tokenizer.encode(rest, add_special_tokens=False)

    def fitted(self, results: list[str], closes_turn: bool, max_tokens: int) -> list[int]:
        """`ids` with the results' text cut (each to the same share, halving) until the turn has at most max_tokens
        tokens; a turn that does not fit with empty results is returned whole (the caller's budget decides)."""
        limit = max_tokens
        while True:
            cut = [r[:limit] + ("..." if len(r) > limit else "") for r in results]
            ids = self.ids(cut, closes_turn)
            if len(ids) <= max_tokens or limit == 0:
                return ids
            limit //= 2
