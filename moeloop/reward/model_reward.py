"""`reward.fn=reward_model`: a neural reward model (a `transformers` sequence classifier with one output, as the
Bradley-Terry reward models of OpenRLHF, verl and TRL are) scoring each prompt and response.

    reward:
      fn: reward_model
      fn_options: {path: /models/my-rm, device: cuda, dtype: bfloat16, max_batch: 64}
      concurrency: 64       # calls in flight: the most one forward can batch
      timeout_s: 60         # a call's wait includes its batch's forward (and the one before it)

It is an async reward function: the calls in flight on the reward pool's event loop (or the reward service's) are
scored together, one padded forward per batch, in a thread, one forward at a time; calls that arrive during a
forward make the next batch. The text scored is the row's chat messages plus the response, through the reward
model's own chat template when it has one (its template, not the policy's); otherwise the policy's prompt text
followed by the response.
"""
from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import torch

from moeloop.errors import InputError
from moeloop.types import Sample

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelReward:
    def __init__(self, path: str = "", device: str = "cpu", dtype: str = "float32", max_batch: int = 64,
                 max_length: int = 4096):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        where = "reward.fn_options"
        if not path or not (Path(path) / "config.json").is_file():
            raise InputError(f"{where}.path={path!r}: not a model folder with a config.json (reward.fn=reward_model "
                             f"needs a transformers sequence-classification model)")
        if dtype not in DTYPES:
            raise InputError(f"{where}.dtype={dtype!r}: must be {'|'.join(DTYPES)}")
        if max_batch < 1 or max_length < 2:
            raise InputError(f"{where}: max_batch must be >= 1 and max_length >= 2, got {max_batch} and {max_length}")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.tokenizer.padding_side, self.tokenizer.truncation_side = "right", "left"  # keep the response's end
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
        if self.model.config.num_labels != 1:
            raise InputError(f"{where}.path={path}: a reward model has one output (num_labels=1), this one has "
                             f"{self.model.config.num_labels}")
        if self.model.config.pad_token_id is None:  # the classifier reads the last token before the first pad
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device, self.max_batch, self.max_length = torch.device(device), max_batch, max_length
        self.num_forwards = 0
        self._pending: list[tuple[str, asyncio.Future]] = []
        self._forward_lock: asyncio.Lock | None = None
        self._flushes: set[asyncio.Task] = set()  # (the loop keeps only weak references to its tasks)

    def text(self, sample: Sample) -> str:
        """What the reward model reads for `sample`."""
        messages = sample.metadata.get("messages")
        if messages is not None and getattr(self.tokenizer, "chat_template", None):
            chat = [*messages, {"role": "assistant", "content": sample.response_text}]
            return self.tokenizer.apply_chat_template(chat, tokenize=False)
        return sample.prompt_text + sample.response_text

    @torch.no_grad()
    def score_texts(self, texts: list[str]) -> list[float]:
        """One padded forward over `texts`; each one's scalar score."""
        batch = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length,
                               add_special_tokens=False)
        self.num_forwards += 1
        logits = self.model(**batch.to(self.device)).logits
        return logits[:, 0].float().cpu().tolist()

    async def __call__(self, sample: Sample) -> float:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._pending.append((self.text(sample), future))
        if len(self._pending) == 1:  # the first of a batch: its flush runs once the calls made with it have queued
            task = loop.create_task(self._flush())
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)
        return await future

    async def _flush(self) -> None:
        if self._forward_lock is None:
            self._forward_lock = asyncio.Lock()
        async with self._forward_lock:  # one forward at a time; calls arriving meanwhile wait for the next batch
            while self._pending:
                batch, self._pending = self._pending[:self.max_batch], self._pending[self.max_batch:]
                live = [(text, future) for text, future in batch if not future.done()]  # (a timed-out call: dropped)
                if not live:
                    continue
                try:
                    scores = await asyncio.to_thread(self.score_texts, [text for text, _ in live])
                except Exception as err:  # noqa: BLE001 - each waiting call gets the error (the pool retries)
                    for _, future in live:
                        if not future.done():
                            future.set_exception(err)
                    continue
                for (_, future), score in zip(live, scores):
                    if not future.done():
                        future.set_result(score)


def model_reward(**options: Any) -> ModelReward:
    """The built-in's factory: `reward.fn_options` are ModelReward's arguments; an unknown one is named."""
    known = ("path", "device", "dtype", "max_batch", "max_length")
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise InputError(f"reward.fn_options: {', '.join(unknown)} unknown to reward.fn=reward_model "
                         f"(it takes {', '.join(known)})")
    return ModelReward(**options)
