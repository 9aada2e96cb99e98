"""`Engine`: continuous batching over a paged KV cache — requests in, `Completion`s out.

    engine = Engine(model, RolloutSection(max_num_seqs=64, kv_cache_bytes=1 << 30))
    outs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(n=8, temperature=1.0, seed=0))

Incremental use: `add_request(...)`, then `step()` until `has_unfinished()` is False (each step returns the
completions that finished in it). Weight updates follow the drain gate:

    engine.pause(); done = engine.drain()          # or drain(abort=True): abort + re-queue from the prompt
    engine.update_weights(trainer_named_tensors, version=step)   # raises unless drained
    engine.resume()

`sleep()` frees the KV cache (colocated training), `wake()` re-allocates it; both need a drained engine.

Async scheduling (`rollout.async_scheduling`, on by default on CUDA): `step()` queues step t on the device,
then appends the tokens of step t - 1 while the device works, so host bookkeeping (scheduling, input
building, stop checks) overlaps the forward. Step t's inputs that are still pending come from step t - 1's
tokens on the device. A completion is returned one `step()` later than in sync mode, and a sequence that
stops on a token of step t - 1 has already been scheduled in step t: that one extra token is dropped.
Outputs are identical to sync mode (tests/test_rollout_async.py).

Multi-step decode (`rollout.decode_steps`, 8 by default on CUDA): a decode-only batch runs up to K steps per
launch, sampling included, with no host round trip (see `scheduler` and `multistep`); tokens past a stop are
dropped. Outputs are identical to one step per launch (tests/test_rollout_multistep.py).
"""
from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from moeloop.config.schema import RolloutSection
from moeloop.errors import InputError
from moeloop.rollout.blocks import BlockManager
from moeloop.rollout.completion import Completion
from moeloop.rollout.decode_packs import derive_decode_weights
from moeloop.rollout.fused_decode import decode_weights_apply
from moeloop.rollout.kv_cache import KVCache, kv_budget_bytes, kv_bytes_per_block
from moeloop.rollout.paged_attention import slots_of
from moeloop.rollout.runner import LaunchedStep, ModelRunner
from moeloop.rollout.sampling_params import SamplingParams
from moeloop.rollout.scheduler import ScheduledBatch, Scheduler
from moeloop.rollout.sequence import Sequence, SequenceStatus


class Engine:
    def __init__(self, model: nn.Module, cfg: RolloutSection | None = None, *,
                 detokenize: Callable[[list[int]], str] | None = None,
                 eos_token_ids: Iterable[int] | None = None, seed: int = 0):
        self.cfg = cfg = cfg or RolloutSection()
        cfg.check()
        self.model = model.eval()
        param = next(model.parameters())
        mcfg = model.cfg
        # the fused decode's derived weights, allocated before the KV budget is taken
        derived = derive_decode_weights(model) if decode_weights_apply(model) else []
        budget = kv_budget_bytes(cfg.kv_cache_bytes, cfg.gpu_memory_utilization, param.device)
        per_block = kv_bytes_per_block(mcfg, cfg.block_size, param.dtype, cfg.record_routes)
        num_blocks = budget // per_block - 1  # one scratch block
        if num_blocks < 1:
            raise InputError(f"rollout.kv_cache_bytes: a KV budget of {budget} bytes holds {budget // per_block} blocks of "
                             f"{per_block} bytes; the engine needs at least 2 (one is scratch)")
        self.cache = KVCache(mcfg, num_blocks, cfg.block_size, param.dtype, param.device, cfg.record_routes)
        self.blocks = BlockManager(num_blocks, cfg.block_size)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        steps = cfg.decode_steps or (8 if param.device.type == "cuda" else 1)
        self.runner = ModelRunner(model, self.cache, cfg.max_num_seqs, cfg.max_model_len, cfg.enforce_eager, derived,
                                  steps)
        self.async_scheduling = cfg.async_scheduling == "on" or (cfg.async_scheduling == "auto"
                                                                 and param.device.type == "cuda")
        self._in_flight: LaunchedStep | None = None
        self._ready: list[Completion] = []  # finished while flushing for abort(); handed out by the next step()
        self.detokenize = detokenize
        eos = mcfg.eos_token_id if eos_token_ids is None else list(eos_token_ids)
        self.eos_token_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.policy_version = 0
        self._seeds = random.Random(seed)
        self._request_ids = itertools.count()
        self._live: dict[str, int] = {}  # request id -> its samples not yet completed
        self._weights_consistent = True
        self.num_generated_tokens = self.num_prefill_tokens = self.num_steps = 0

    # --- requests ------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        self._check_prompt(prompt_ids, params)
        return self._queue(prompt_ids, params, request_id)

    def _queue(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """`add_request` for a prompt `_check_prompt` has passed. A request id names one live request: a given one
        that is still live is refused, and an automatic one skips the ids live now."""
        if request_id is None:
            request_id = str(next(self._request_ids))
            while request_id in self._live:
                request_id = str(next(self._request_ids))
        elif request_id in self._live:
            raise InputError(f"request id {request_id!r} is still running: ids name one live request (their "
                             f"completions and abort() go by it)")
        self._live[request_id] = params.n
        base_seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        leader = None
        for i in range(params.n):
            seq = Sequence(request_id, i, prompt_ids, params, seed=_sample_seed(base_seed, i), leader=leader)
            leader = leader or seq
            self.scheduler.add(seq)
        return request_id

    def _check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InputError("empty prompt: need at least one token id")
        vocab = self.model.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InputError(f"prompt token ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise InputError(f"stop_token_ids must be in [0, {vocab}), got {list(params.stop_token_ids)}")
        total = len(prompt_ids) + params.max_tokens
        if total > self.cfg.max_model_len:
            raise InputError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) = {total} "
                             f"> rollout.max_model_len={self.cfg.max_model_len}")
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            raise InputError(f"one sequence of {total} tokens needs {self.blocks.blocks_for(total)} KV blocks; "
                             f"the cache has {self.blocks.num_blocks}: raise rollout.kv_cache_bytes")
        if params.stop and self.detokenize is None:
            raise InputError("stop strings need a detokenize callback (Engine(..., detokenize=tokenizer.decode))")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None or bool(self._ready)

    def step(self) -> list[Completion]:
        """Run one scheduled batch; return the completions that finished in it (async: in the step before)."""
        if not self._weights_consistent:
            raise RuntimeError("weights are half-updated (an update_weights call failed): update again first")
        if not self.cache.is_allocated:
            raise RuntimeError("the engine is asleep: call wake() first")
        if self._in_flight is None and not self.scheduler.running:  # idle: weights may have changed in place since
            self.runner.refresh_weights()  # (while sequences run they may not: update_weights needs a drain)
        batch = self.scheduler.schedule(self.runner.decode_steps, self.runner.step_counts)
        launched = self._launch(batch) if batch.seqs else None
        done, self._ready = self._ready + self._flush(), []
        self._in_flight = launched
        if not self.async_scheduling:
            done += self._flush()
        return done

    def _launch(self, batch: ScheduledBatch) -> LaunchedStep:
        launched = self.runner.launch(batch, self._in_flight)
        K = batch.num_steps
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if n > 1 or seq.num_computed_tokens < seq.num_prompt_tokens:  # prompt chunks and recomputes
                self.num_prefill_tokens += n
            seq.num_computed_tokens += n * K  # K > 1: decode rows only (n = 1)
        for seq in launched.sampled:
            seq.num_pending += K
        self.num_steps += K
        return launched

    def _flush(self) -> list[Completion]:
        """Append the tokens of the launch in flight (waiting for them) and finish the sequences they end."""
        launched, self._in_flight = self._in_flight, None
        if launched is None:
            return []
        tokens_KB, logprobs_KB = launched.result()
        commit, finish_reason, version = self.blocks.commit, self._finish_reason, self.policy_version  # hot loop
        for seq in launched.seqs:
            commit(seq)
        done, route_slots = [], []
        finished = SequenceStatus.FINISHED
        for k, tokens in enumerate(tokens_KB):  # multi-step decode: step by step, so a stop drops what follows it
            logprobs = logprobs_KB[k] if logprobs_KB is not None else None
            for j, seq in enumerate(launched.sampled):
                if seq.status is finished:  # it stopped earlier; this token was computed past its end
                    continue
                self.num_generated_tokens += 1
                seq.append(tokens[j], logprobs[j] if seq.params.logprobs else None, version)
                reason = finish_reason(seq)
                if reason is not None:
                    if self.cache.routes is not None:  # its slots, before its blocks go
                        route_slots.append(self._computed_slots(seq))
                    self.scheduler.finish(seq, reason)
                    done.append(self._completion(seq))
        if route_slots:
            self._attach_routes(done, route_slots)
        return done

    def _finish_reason(self, seq: Sequence) -> str | None:
        p, last = seq.params, seq.token_ids[-1]
        if last in p.stop_token_ids or (not p.ignore_eos and last in self.eos_token_ids):
            return "stop"
        if p.stop and any(s in self.detokenize(seq.response_ids) for s in p.stop):
            return "stop"
        num_tokens = len(seq.token_ids)  # known on the host (pending ones excluded)
        if num_tokens - seq.num_prompt_tokens >= p.max_tokens or num_tokens >= self.cfg.max_model_len:
            return "length"
        return None

    def _computed_slots(self, seq: Sequence) -> torch.Tensor:
        """The KV slots of the sequence's positions but the last (those the engine computed)."""
        return slots_of(torch.tensor(seq.block_table), torch.arange(len(seq.token_ids) - 1), self.cache.block_size)

    def _attach_routes(self, completions: list[Completion], slots: list[torch.Tensor]) -> None:
        """Each completion's recorded experts, int16 [positions, L_moe, K], read from its `_computed_slots` in one
        gather and one copy home (a shared prompt block holds the routes its first computation wrote, as it holds its
        K/V; the blocks freed since are not written before the next launch)."""
        flat = torch.cat(slots).to(self.cache.routes.device)
        routes_SLK = self.cache.routes.index_select(1, flat).transpose(0, 1).cpu().numpy()
        start = 0
        for completion, seq_slots in zip(completions, slots):
            completion.routed_experts = routes_SLK[start:start + len(seq_slots)]
            start += len(seq_slots)

    def _completion(self, seq: Sequence) -> Completion:
        """The completion of a finished (or aborted) sample; its request stops being live with its last one."""
        left = self._live.pop(seq.request_id) - 1
        if left:
            self._live[seq.request_id] = left
        text = self.detokenize(seq.response_ids) if self.detokenize is not None else None
        return Completion(seq.request_id, seq.sample_index, seq.prompt_ids, seq.response_ids,
                          list(seq.logprobs) if seq.params.logprobs else None, seq.finish_reason,
                          seq.policy_version if seq.response_ids else self.policy_version, text,
                          seq.num_preemptions)

    def abort(self, request_id: str) -> list[Completion]:
        """Finish every sample of a request now, with finish_reason "abort" and what it has generated
        (completions that finish normally on the step in flight are dropped: the request is aborted)."""
        flushed = self._flush()
        self._ready += [c for c in flushed if c.request_id != request_id]  # others: returned by the next step()
        seqs = [s for s in list(self.scheduler.running) + list(self.scheduler.waiting) if s.request_id == request_id]
        for seq in seqs:
            if seq in self.scheduler.waiting:
                self.scheduler.waiting.remove(seq)
            self.scheduler.finish(seq, "abort")
        return [c for c in flushed if c.request_id == request_id] + [self._completion(s) for s in seqs]

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 progress: Callable[[int], None] | None = None) -> list[Completion]:
        """Completions of every prompt, prompt-major then sample index. `progress(k)`: k samples just finished."""
        if self.scheduler.paused:
            raise RuntimeError("generate on a paused engine would never finish: call resume() first")
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InputError(f"generate: {len(prompts)} prompts but {len(params_list)} SamplingParams")
        for i, (p, sp) in enumerate(zip(prompts, params_list)):  # all checked before any is queued
            try:
                self._check_prompt(p, sp)
            except InputError as err:
                raise InputError(f"prompt {i}: {err}") from None
        ids = [self._queue(p, sp) for p, sp in zip(prompts, params_list)]
        wanted, results, total, others = set(ids), {}, sum(sp.n for sp in params_list), []
        while self.has_unfinished() and len(results) < total:
            for c in self.step():
                if c.request_id in wanted:
                    results[(c.request_id, c.sample_index)] = c
                    if progress:
                        progress(1)
                else:  # a request of `add_request`'s that finished meanwhile: the next step() returns it
                    others.append(c)
        self._ready = others + self._ready
        return [results[(rid, i)] for rid, sp in zip(ids, params_list) for i in range(sp.n)]

    # --- control -------------------------------------------------------------------------------
    def pause(self) -> None:
        """Stop admitting waiting sequences; running ones continue while `step()` is called."""
        self.scheduler.paused = True

    def resume(self) -> None:
        self.scheduler.paused = False

    @property
    def is_drained(self) -> bool:
        return not self.scheduler.running and self._in_flight is None

    def drain(self, abort: bool = False) -> list[Completion]:
        """Empty the running set. abort=False: step until in-flight samples finish (returned); abort=True: drop
        their partial responses and re-queue them from the prompt (so no sample mixes two policy versions)."""
        if abort:
            done = self._flush()
            self.scheduler.requeue_running()
            return done
        paused, self.scheduler.paused = self.scheduler.paused, True
        done = []
        try:
            while not self.is_drained:
                done += self.step()
        finally:
            self.scheduler.paused = paused
        return done

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Iterator[tuple[str, torch.Tensor]],
                       version: int | None = None) -> None:
        """Copy (name, tensor) pairs (our state_dict names; every parameter once) into the live parameters in
        place, then bump the policy version. Only while drained; stale prefix-cache entries are dropped. A head tied
        to the embedding is one parameter under both state_dict names (the trainer's stream has both)."""
        if not self.is_drained:
            raise RuntimeError(f"update_weights while {len(self.scheduler.running)} sequences are in flight: "
                               "call pause() and drain() first")
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(dict(self.model.named_buffers()))
        seen: set[str] = set()
        self._weights_consistent = False
        for name, tensor in named_tensors:
            if name not in targets:
                raise KeyError(f"update_weights: unknown tensor {name!r}")
            if tuple(tensor.shape) != tuple(targets[name].shape):
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(targets[name].shape)}")
            targets[name].copy_(tensor)
            seen.add(name)
        missing = set(dict(self.model.named_parameters())) - seen
        if missing:
            raise ValueError(f"update_weights: {len(missing)} parameters missing, e.g. {sorted(missing)[:3]}")
        self._weights_consistent = True
        self.runner.refresh_weights(force=True)  # shared parameters change without the engine's counters moving
        self.blocks.reset_prefix_cache()
        self.policy_version = self.policy_version + 1 if version is None else int(version)

    def sleep(self) -> None:
        """Free the KV cache memory (and the CUDA graphs that point into it). Needs a drained engine."""
        if not self.is_drained:
            raise RuntimeError("sleep() needs a drained engine: call pause() and drain() first")
        self.runner.drop_graphs()
        self.blocks.reset_prefix_cache()
        self.cache.free()

    def wake(self) -> None:
        if not self.cache.is_allocated:
            self.cache.allocate()


def _sample_seed(base_seed: int, sample_index: int) -> int:
    digest = hashlib.blake2b(f"{base_seed}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
