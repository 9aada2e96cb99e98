"""`ModelRunner`: owns the model's device tensors for a step — packs the scheduled chunks into one flat
stream, builds the paged-attention metadata, runs the forward (or a captured CUDA graph for decode-only
batches), and samples the sequences that reached their last token (a batch with a repetition penalty or min-p also
gets those rows' tensors, `logit_processors`).
"""
# T tokens in the step, B sampled sequences, V vocab, N blocks per sequence
from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from torch import nn

from moeloop.model.kernel_switch import kernels_apply
from moeloop.model.moe import MoE
from moeloop.rollout.cuda_graphs import CaptureFailed, DecodeGraphs
from moeloop.rollout.decode_packs import DerivedWeights
from moeloop.rollout.fused_decode import fused_decode_forward, fused_decode_logits, fused_supported
from moeloop.rollout.kv_cache import KVCache
from moeloop.rollout.logit_processors import PendingTokens, processing_fields
from moeloop.rollout.moe_kernel import decode_moe
from moeloop.rollout.multistep import decode_steps, step_sampler
from moeloop.rollout.paged_attention import AttentionMetadata, PagedAttention, PrefillChunk
from moeloop.rollout.sampler import Sampler, SamplingTensors, row_keys
from moeloop.rollout.sampling_params import SamplingParams
from moeloop.rollout.scheduler import ScheduledBatch
from moeloop.rollout.sequence import Sequence
from moeloop.transfer import to_device, upload

# session 13: with CUDA graphs a batch with 1 < r < K tokens left runs them in one launch of r steps
# (`ModelRunner.step_counts`); MOELOOP_TAIL_STEP_COUNTS=off: one step a launch, as before
TAIL_STEP_COUNTS = os.environ.get("MOELOOP_TAIL_STEP_COUNTS", "on").lower() != "off"


@dataclass
class LaunchedStep:
    """One step's work queued on the device: the batch, the sequences that sample, their sampled tokens on the
    device (the next step's inputs) and the host copy in flight. `result()` waits for that copy only."""

    seqs: list[Sequence]
    sampled: list[Sequence]
    num_steps: int = 1  # K: decode steps run on the device (multi-step decode)
    tokens_B: torch.Tensor | None = None  # the last step's tokens
    host_XKB: torch.Tensor | None = None  # [K or 2K, >= B] float64: each step's tokens (then each step's logprobs)
    out_XKB: torch.Tensor | None = None  # the same on the device (a penalised row's pending tokens, `_pending_samples`)
    ready: torch.cuda.Event | None = None
    row_of: dict[int, int] = field(default_factory=dict)  # seq_id -> row in tokens_B

    def result(self) -> tuple[list[list[int]], list[list[float]] | None]:
        """Tokens [K][B] of the sampled sequences (and their logprobs [K][B], or None); waits for the copy only."""
        if self.host_XKB is None:
            return [], None
        if self.ready is not None:
            self.ready.synchronize()
        K, B = self.num_steps, len(self.sampled)
        rows = self.host_XKB[:, :B].tolist()
        return [[int(t) for t in row] for row in rows[:K]], rows[K:] or None


class ModelRunner:
    def __init__(self, model: nn.Module, cache: KVCache, max_num_seqs: int, max_model_len: int,
                 enforce_eager: bool = False, derived: list[DerivedWeights] | None = None, decode_steps: int = 1):
        self.model, self.cache = model, cache
        # the fused forward's derived weights (`derive_decode_weights`: packed q|k|v copies, composed routers),
        # kept fresh here
        self.derived = derived or []
        self.device = next(model.parameters()).device
        self.vocab_size = model.cfg.vocab_size
        self.sampler = Sampler()
        self.use_kernel = kernels_apply(next(model.parameters()))  # CUDA, triton, the switch on
        self.max_blocks_per_seq = -(-max_model_len // cache.block_size)
        self._moe_blocks = [m for m in model.modules() if isinstance(m, MoE)]
        self.fused_ok = fused_supported(model)  # the fused decode forward applies (used with the kernels)
        self.graphs: DecodeGraphs | None = None
        if self.use_kernel and not enforce_eager:
            self.graphs = DecodeGraphs(model, cache, max_num_seqs, self.max_blocks_per_seq, fused=self.fused_ok)
        self.decode_steps = decode_steps  # the most steps a launch runs (multi-step decode); 1 after a failed capture
        # two alternating host buffers for the sampled tokens: step t's is read before step t + 2 reuses it
        pin = self.device.type == "cuda"
        size = 2 * decode_steps * max_num_seqs
        self._out_host = [torch.empty(size, dtype=torch.float64, pin_memory=pin) for _ in range(2)]
        self._out_turn = 0

    @property
    def step_counts(self) -> tuple[int, ...] | None:
        """The step counts a multi-step launch may run: with CUDA graphs (one per step count, captured when first
        needed) K = `decode_steps` down to 2, so a batch with 1 < r < K tokens left runs them in one launch rather
        than one step a launch (H200, B=1, 255 decode tokens: 97.4 ms, against 98.4 ms with one step a launch for
        the last 7; BENCHMARKS.md, session 13); None (any count up to K) without graphs."""
        if self.graphs is None:
            return None
        return tuple(range(self.decode_steps, 1, -1)) if TAIL_STEP_COUNTS else (self.decode_steps,)

    def refresh_weights(self, force: bool = False) -> None:
        """Re-copy packed weights whose sources changed (force: all of them; after `Engine.update_weights`)."""
        for pack in self.derived:
            pack.refresh(force)

    def drop_graphs(self) -> None:
        """Captured graphs point at KV memory; call before the cache is freed (sleep)."""
        if self.graphs is not None:
            self.graphs.clear()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[int], list[float] | None]:
        """Forward one scheduled batch and wait; (token, logprob) of each sequence that samples, in batch order."""
        return self.launch(batch).result()

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the forward and sampling of one batch on the device and return without waiting for it.

        A decode row whose input token is still pending on the host (sampled by `prev`, not yet appended) takes
        it from `prev.tokens_B` on the device, so consecutive steps need no host round trip in between."""
        own = batch.sample_rows()
        rows = own + [i for _, i in batch.forks]  # a fork samples from its leader's logits row
        sampled = [batch.seqs[i] for i in own] + [f for f, _ in batch.forks]
        step = LaunchedStep(batch.seqs, sampled, batch.num_steps)
        patch = _pending_inputs(batch, prev)
        if batch.num_steps > 1:
            return self._launch_steps(batch, patch, step, prev)
        # after a multi-step launch, before the forward: a penalised row's pending tokens are that graph's output, in
        # the graph pool the forward's graph reuses
        st = self._sampling_tensors(sampled, prev) if rows and prev is not None and prev.num_steps > 1 else None
        with decode_moe(self.model, self._moe_blocks, kernels=self.use_kernel):
            logits_TV = self._graph_logits(batch, patch, rows)  # never with forks: their leader's chunk is >= 2
            if logits_TV is None:
                logits_TV = self._eager_logits(batch, patch, rows)
        if batch.forks:
            self._copy_fork_tails(batch)
        if logits_TV is None:
            return step
        if st is None:
            st = self._sampling_tensors(sampled, prev)
        want_logprobs = any(s.params.logprobs for s in sampled)
        tokens_B, logprobs_B = self.sampler(logits_TV, st, want_logprobs)
        out_XB = torch.empty(1 if logprobs_B is None else 2, len(tokens_B), dtype=torch.float64, device=self.device)
        out_XB[0].copy_(tokens_B)  # casting copies: one launch a row (a stack of casts was three)
        if logprobs_B is not None:
            out_XB[1].copy_(logprobs_B)
        return self._send_home(step, tokens_B, out_XB)

    def _send_home(self, step: LaunchedStep, tokens_B: torch.Tensor, out_XKB: torch.Tensor) -> LaunchedStep:
        """Queue the copy of the step's tokens (and logprobs) to the host; tokens_B stay as the next step's inputs."""
        step.tokens_B, step.out_XKB, step.row_of = tokens_B, out_XKB, {s.seq_id: j for j, s in enumerate(step.sampled)}
        if self.device.type == "cuda":
            # a contiguous prefix of the flat pinned buffer: a strided destination would make the copy synchronous
            host = self._out_host[self._out_turn][:out_XKB.numel()].view(out_XKB.shape)
            self._out_turn ^= 1
            host.copy_(out_XKB, non_blocking=True)
            step.host_XKB, step.ready = host, torch.cuda.Event()
            step.ready.record()
        else:
            step.host_XKB = out_XKB
        return step

    def _launch_steps(self, batch: ScheduledBatch, patch: "InputPatch | None", step: LaunchedStep,
                      prev: LaunchedStep | None) -> LaunchedStep:
        """Queue `batch.num_steps` decode steps of a decode-only batch (multi-step decode; see `multistep`)."""
        K, B = batch.num_steps, len(batch)
        floats, ints, flags = self._sampling_host(batch.seqs, K)
        want_logprobs = any(s.params.logprobs for s in batch.seqs)
        processing = None  # a repetition penalty or min-p: their tensors (the seen mask grows step by step)
        if any(s.params.processes_logits for s in batch.seqs):
            processing = processing_fields(batch.seqs, _pending_samples(batch.seqs, prev), self.vocab_size, self.device)
        result = None
        with decode_moe(self.model, self._moe_blocks, kernels=self.use_kernel):
            while result is None and self.graphs is not None and self.graphs.fits(B):
                try:
                    result = self.graphs.run_steps(decode_inputs(batch, self.cache.block_size), patch, floats, ints,
                                                   flags, want_logprobs, K, self.sampler, processing)
                except CaptureFailed:
                    if not self.graphs.failed:  # the one-step graphs hold: one decode step a launch from now on
                        warnings.warn("CUDA graph capture of the multi-step decode failed; one decode step per launch")
                        self.decode_steps = 1
                        break
                    self._after_failed_capture()  # the one-step ladder failed: retry as _graph_logits does
            if result is None:
                result = self._eager_steps(batch, patch, floats, ints, flags, want_logprobs, processing)
        out_XKS, tokens_S = result
        return self._send_home(step, tokens_S[:B], out_XKS)

    def _eager_steps(self, batch: ScheduledBatch, patch: "InputPatch | None", floats: torch.Tensor,
                     ints: torch.Tensor, flags: dict, want_logprobs: bool,
                     processing: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [X * K, B], last tokens [B]) of the batch's K decode steps, op by op; `processing`: the rows'
        `processing_fields`, or None."""
        K = batch.num_steps
        ids, pos, slots, meta, _ = self._prepare(batch)
        self._patch(ids, patch)
        floats, ints = upload(floats, self.device), upload(ints, self.device)
        st = SamplingTensors.packed(floats, ints, flags)
        sample = step_sampler(self.sampler, replace(st, **processing) if processing else st, ints[1:], want_logprobs)
        out = torch.empty((2 if want_logprobs else 1) * K, len(batch), dtype=torch.float64, device=self.device)

        def forward(k: int) -> torch.Tensor:
            ctx = PagedAttention(self.cache, replace(meta, max_decode_len=meta.max_decode_len + k), self.use_kernel)
            return self._decode_logits(ids, pos, ctx)

        tokens = decode_steps(forward, sample, ids, pos, slots, meta.context_lens_B, meta.block_tables_BN,
                              self.cache.block_size, K, out)
        return out, tokens

    def _graph_logits(self, batch: ScheduledBatch, patch: "InputPatch | None", rows: list[int]) -> torch.Tensor | None:
        """Logits of a decode-only batch (every row samples) through the CUDA graphs; None when not applicable."""
        if self.graphs is None or not self.graphs.fits(len(batch)) or any(n != 1 for n in batch.num_new_tokens):
            return None
        try:
            logits_BV = self.graphs.run(*decode_inputs(batch, self.cache.block_size), patch)
        except CaptureFailed:
            self._after_failed_capture()
            return self._graph_logits(batch, patch, rows)
        # a 1-token prompt chunk does not sample
        return logits_BV if len(rows) == len(batch) else logits_BV[rows] if rows else None

    def _after_failed_capture(self) -> None:
        """The ladder's capture failed: with the fused forward (e.g. a fused kernel that does not compile here), capture
        the module forward next; with the module forward, run eagerly for good."""
        if self.graphs.fused:
            self._disable_fused("CUDA graph capture of the fused decode forward failed")
            self.graphs = DecodeGraphs(self.model, self.cache, self.graphs.sizes[-1], self.max_blocks_per_seq)
        else:
            self.graphs = None

    def _eager_logits(self, batch: ScheduledBatch, patch: "InputPatch | None", rows: list[int]) -> torch.Tensor | None:
        ids, pos, slots, meta, last_rows = self._prepare(batch)
        sample_rows = [last_rows[i] for i in rows]
        self._patch(ids, patch)
        ctx = PagedAttention(self.cache, meta, self.use_kernel)
        if sample_rows and sample_rows == list(range(ids.shape[0])):  # every row samples: as the graphs compute it
            return self._decode_logits(ids, pos, ctx)
        hidden_TD = self._hidden(ids, pos, ctx)
        return None if not sample_rows else self.model.compute_logits(hidden_TD[sample_rows])

    def _patch(self, ids_T: torch.Tensor, patch: "InputPatch | None") -> None:
        if patch is not None:
            dst, src, tokens_B = patch
            ids_T[to_device(dst, self.device)] = tokens_B[to_device(src, self.device)]

    def _hidden(self, ids_T: torch.Tensor, pos_T: torch.Tensor, ctx: PagedAttention) -> torch.Tensor:
        """Hidden states [T, D] of the stream: the fused decode forward where it applies, else the module forward."""
        return self._fused_or_module(fused_decode_forward, self.model, ids_T, pos_T, ctx)

    def _decode_logits(self, ids_T: torch.Tensor, pos_T: torch.Tensor, ctx: PagedAttention) -> torch.Tensor:
        """Logits [T, V] of a decode-only stream, as the decode graphs compute them (`fused_decode_logits`)."""
        return self._fused_or_module(fused_decode_logits, lambda *a: self.model.compute_logits(self.model(*a)),
                                     ids_T, pos_T, ctx)

    def _fused_or_module(self, fused, module, ids_T: torch.Tensor, pos_T: torch.Tensor,
                         ctx: PagedAttention) -> torch.Tensor:
        """fused(model, ...) for a decode-only stream while the fused forward is on (it is switched off for good,
        with a warning, the first time it raises), else module(...)."""
        meta = ctx.meta
        if self.use_kernel and self.fused_ok and meta.decode_rows_B is None and not meta.prefills:
            try:
                return fused(self.model, ids_T, pos_T, ctx)
            except Exception as err:  # the module forward rewrites the same K/V slots, so nothing is half-done
                self._disable_fused(f"the fused decode forward failed ({err!r})")
        return module(ids_T, pos_T, ctx)

    def _disable_fused(self, why: str) -> None:
        warnings.warn(f"{why}; decoding with the module forward from now on")
        self.fused_ok = False

    def _copy_fork_tails(self, batch: ScheduledBatch) -> None:
        """K/V of the partial last prompt block: from each fork's leader (just computed) to the fork's own block."""
        bs, src, dst = self.cache.block_size, [], []
        for seq, i in batch.forks:
            num_full, tail = divmod(seq.num_prompt_tokens, bs)
            if tail:
                src += range(batch.seqs[i].block_table[num_full] * bs, batch.seqs[i].block_table[num_full] * bs + tail)
                dst += range(seq.block_table[num_full] * bs, seq.block_table[num_full] * bs + tail)
        if src:
            src_S, dst_S = to_device(src, self.device), to_device(dst, self.device)
            for kv_LSGD in (self.cache.k, self.cache.v) + ((self.cache.routes,) if self.cache.routes is not None else ()):
                kv_LSGD.index_copy_(1, dst_S, kv_LSGD.index_select(1, src_S))

    def _prepare(self, batch: ScheduledBatch):
        """Flat inputs and attention metadata of the batch, and the stream row of each sequence's last token."""
        ids, pos, slots, last_rows = [], [], [], []
        decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
        bs = self.cache.block_size
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, first = len(ids), seq.num_computed_tokens
            ctx_len = first + n
            ids += seq.token_ids[first:ctx_len]
            ids += [0] * (ctx_len - first - (len(ids) - start))  # pending tokens: patched on the device
            pos += range(first, ctx_len)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(first, ctx_len)]
            if n == 1:
                decode_rows.append(start)
                decode_tables.append(table)
                decode_lens.append(ctx_len)
            else:
                prefills.append((start, n, ctx_len, table))
            last_rows.append(start + n - 1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping_T=to_device(slots, dev),
            decode_rows_B=None if not prefills else to_device(decode_rows, dev),
            block_tables_BN=_pad_tables(decode_tables, dev),
            context_lens_B=to_device(decode_lens, dev, torch.int32),
            max_decode_len=max(decode_lens, default=0), prefills=[])
        meta.prefills = [PrefillChunk(start, n, ctx_len, table if ctx_len > n else None)
                         for start, n, ctx_len, table in prefills]
        ids_T, pos_T = to_device(ids, dev), to_device(pos, dev)
        return ids_T, pos_T, meta.slot_mapping_T, meta, last_rows

    def _sampling_tensors(self, seqs: list[Sequence], prev: LaunchedStep | None = None) -> SamplingTensors:
        """The rows' sampling tensors on the device (one step); with a repetition penalty or min-p in some row,
        their tensors too (a penalised row's last token may still be in `prev.tokens_B` only)."""
        floats, ints, flags = self._sampling_host(seqs)
        st = SamplingTensors.packed(upload(floats, self.device), upload(ints, self.device), flags)
        if not any(s.params.processes_logits for s in seqs):
            return st
        return replace(st, **processing_fields(seqs, _pending_samples(seqs, prev), self.vocab_size, self.device))

    def _sampling_host(self, seqs: list[Sequence], steps: int = 1) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Host tensors of the rows' sampling: floats [2, B] (temperatures, top-ps), ints [1 + steps, B] (top-ks,
        then the row keys of each step: a row's k-th step samples its response token num_response_tokens + k) and
        the `SamplingTensors` flags."""
        V, B = self.vocab_size, len(seqs)
        params = [s.params for s in seqs]
        uniform = params.count(params[0]) == B  # one SamplingParams for the batch (the usual RL step)
        temps, top_ks, top_ps = _row_params(params[:1] if uniform else params, V)
        flags = dict(any_filter=any(k < V for k in top_ks) or any(p < 1 for p in top_ps),
                     all_greedy=all(t == 0 for t in temps), max_top_k=max(top_ks), any_greedy=any(t == 0 for t in temps),
                     any_top_p=any(p < 1 for p in top_ps))
        counters = np.array([s.num_response_tokens for s in seqs], dtype=np.int64)
        keys = row_keys([s.seed for s in seqs], counters if steps == 1 else counters + np.arange(steps)[:, None])
        floats = torch.tensor([temps, top_ps], dtype=torch.float32)
        top_ks_B = np.array(top_ks, dtype=np.int64)
        if uniform:  # one column each, broadcast: no per-row Python lists
            floats, top_ks_B = floats.expand(2, B).contiguous(), np.broadcast_to(top_ks_B, (B,))
        return floats, torch.from_numpy(np.concatenate([top_ks_B[None], keys.reshape(steps, B)])), flags


def _row_params(params: list[SamplingParams], vocab_size: int) -> tuple[list[float], list[int], list[float]]:
    """(temperatures, top-ks clamped to the vocab, top-ps) of each row's sampling params."""
    V = vocab_size
    return ([p.temperature for p in params], [V if p.top_k == -1 else min(p.top_k, V) for p in params],
            [p.top_p for p in params])


InputPatch = tuple[list[int], list[int], torch.Tensor]  # (input rows, rows of prev.tokens_B, prev.tokens_B)


def decode_inputs(batch: ScheduledBatch, block_size: int) -> tuple[list[int], ...]:
    """(ids, positions, slots, context lengths, block tables) of a decode-only batch, as host lists."""
    bs, seqs = block_size, batch.seqs
    pos = [s.num_computed_tokens for s in seqs]
    # 0: a token still pending on the host, patched in on the device
    ids = [t[p] if p < len(t) else 0 for t, p in zip([s.token_ids for s in seqs], pos)]
    tables = [s.block_table for s in seqs]
    slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
    return ids, pos, slots, [p + 1 for p in pos], tables


def _pending_inputs(batch: ScheduledBatch, prev: LaunchedStep | None) -> InputPatch | None:
    """Input rows whose token was sampled by `prev` and has not reached the host yet (decode rows only)."""
    dst, src, row = [], [], 0
    row_of = prev.row_of if prev is not None else {}
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        if seq.num_computed_tokens + n > len(seq.token_ids):  # its last input token is pending
            j = row_of.get(seq.seq_id)
            if j is None or n != 1:
                raise RuntimeError(f"sequence {seq.seq_id}: input token {seq.num_computed_tokens + n - 1} is pending "
                                   "but not from the last step")
            dst.append(row)
            src.append(j)
        row += n
    return (dst, src, prev.tokens_B) if dst else None


def _pending_samples(seqs: list[Sequence], prev: LaunchedStep | None) -> PendingTokens | None:
    """Rows of the penalised sequences whose last tokens `prev` sampled and the host does not hold yet (the K steps'
    of that launch: one launch is in flight at most), with their rows in prev's tokens [K, S] on the device."""
    dst, src = [], []
    for j, seq in enumerate(seqs):
        if seq.num_pending and seq.params.repetition_penalty != 1:
            if prev is None or seq.num_pending != prev.num_steps or seq.seq_id not in prev.row_of:
                raise RuntimeError(f"sequence {seq.seq_id}: {seq.num_pending} pending tokens, not those of the last "
                                   "launch")
            dst.append(j)
            src.append(prev.row_of[seq.seq_id])
    return (dst, src, prev.out_XKB[:prev.num_steps]) if dst else None


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    return to_device(padded, device, torch.int32).view(len(tables), width)
