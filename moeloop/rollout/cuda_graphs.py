"""`DecodeGraphs`: CUDA graphs of the decode-only forward (model + lm_head) for a ladder of batch sizes.

Inputs live in one flat int64 device buffer (ids | positions | slots | context lengths | block tables) that a
step fills with a single asynchronous host-to-device copy from one of two pinned staging buffers (a buffer is
reused only after its previous copy has finished); ids still pending on the host are then patched in from the
previous step's sampled tokens on the device; a batch of B rows replays the smallest captured size >= B with
the extra rows pointed at the KV cache's scratch block (context length 1), so padding never touches a real
sequence. Attention inside the graph is the Triton paged decode kernel (static shapes).
Multi-step decode (`run_steps`): one graph runs K decode steps with sampling and the on-device input updates of
`multistep.decode_steps`, so the host launches (and waits) once per K tokens; its sampling parameters and row keys
(and a repetition penalty's seen mask, min-p's thresholds) sit in static buffers of that graph, filled before each
replay.
Graphs hold KV and parameter addresses: weights must be updated in place and graphs dropped before sleep.
All graphs share one memory pool, so a graph's outputs may sit where another graph keeps its temporaries: the
engine reads a step's outputs (the host copy, the next step's input patch) before it replays another graph. A
replay outside that order (a benchmark timing one graph mid-generation) can change them; such a caller drops the
engine afterwards (`benchmarks/profile_decode.py`).
"""
from __future__ import annotations

import array
import functools
import time
import traceback
import warnings

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from moeloop.rollout.fused_decode import fused_decode_logits
from moeloop.rollout.multistep import decode_steps, step_sampler
from moeloop.rollout.sampler import SamplingTensors
from moeloop.rollout.kv_cache import KVCache
from moeloop.rollout.paged_attention import AttentionMetadata, PagedAttention
from moeloop.transfer import upload_into


def batch_ladder(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: nn.Module, cache: KVCache, max_batch: int, max_blocks_per_seq: int,
                 fused: bool = False):
        self.model, self.cache, self.fused = model, cache, fused
        self.sizes = batch_ladder(max_batch)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.step_graphs: dict[tuple, tuple] = {}  # (size, steps, sampling flags) -> multi-step decode graph
        self.capture_s: dict[str, float] = {}  # seconds each capture took ("ladder", "steps=K size=S"), for benchmarks
        self.failed = False
        rotary = getattr(model, "rotary", None)  # keep RoPE tables on the device: no host copy inside a graph
        if rotary is not None and hasattr(rotary, "inv_freq_R2"):
            rotary.inv_freq_R2 = rotary.inv_freq_R2.to(next(model.parameters()).device)

    def fits(self, batch_size: int) -> bool:
        return not self.failed and batch_size <= self.sizes[-1]

    def clear(self) -> None:
        self.graphs.clear()
        self.step_graphs.clear()
        self.pool = None

    def _views(self, size: int) -> tuple[torch.Tensor, ...]:
        """(ids, pos, slots, lens [size], tables [size, N]) inside the flat buffer, laid out for `size` rows."""
        ids, pos, slots, lens, tables = self.inputs[:size * (4 + self.max_blocks_per_seq)].split(
            [size, size, size, size, size * self.max_blocks_per_seq])
        return ids, pos, slots, lens, tables.view(size, self.max_blocks_per_seq)

    def _fill(self, size: int, ids: list[int], pos: list[int], slots: list[int], lens: list[int],
              tables: list[list[int]], patch: tuple[list[int], list[int], torch.Tensor] | None = None) -> None:
        # the steady decode: rows 0..n-1 take the previous step's tokens 0..n-1 (dst rises from 0: the last is n-1)
        in_order = patch is not None and patch[0] == patch[1] and patch[0][-1] == len(patch[0]) - 1
        flat, n_in = flat_inputs(size, self.max_blocks_per_seq, self.cache.scratch_block, self.cache.block_size, ids,
                                 pos, slots, lens, tables, None if in_order else patch)
        turn = self._turn = self._turn ^ 1
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()
        staging = self._staging[turn][:len(flat)]
        staging.copy_(torch.frombuffer(flat, dtype=torch.int64))
        self.inputs[:n_in].copy_(staging[:n_in], non_blocking=True)
        if in_order:  # one device copy, no index lists
            self.inputs[:len(patch[0])].copy_(patch[2][:len(patch[0])])
        elif patch is not None:  # ids[rows] = tokens[source rows], on the device
            n_patch = len(patch[0])
            index = self.patch_index[:2 * n_patch]
            index.copy_(staging[n_in:], non_blocking=True)
            self.inputs[:size].index_copy_(0, index[:n_patch], patch[2].index_select(0, index[n_patch:]))
        self._copied[turn] = torch.cuda.Event()
        self._copied[turn].record()

    def capture(self) -> None:
        numel = self.sizes[-1] * (4 + self.max_blocks_per_seq)
        self.inputs = torch.zeros(numel, dtype=torch.int64, device=self.cache.device)
        self.patch_index = torch.zeros(2 * self.sizes[-1], dtype=torch.int64, device=self.cache.device)
        self._staging = [torch.zeros(numel + 2 * self.sizes[-1], dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first so smaller graphs reuse its pool memory
            self._fill(size, [], [], [], [], [])
            self.graphs[size] = self._capture(self._forward(size))

    def _capture(self, run) -> tuple[torch.cuda.CUDAGraph, object]:
        """(graph, its outputs) of `run`, after one warm-up run on a side stream (triton compile, allocator)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = run()
        except Exception as err:
            raise RuntimeError(f"{err!r}; host-touching ops in the decode forward: {host_ops(run)}") from err
        return graph, out

    def _forward(self, size: int):
        ids, pos, slots, lens, tables = self._views(size)
        meta = AttentionMetadata(slots, None, tables, lens, 0, [])
        ctx = PagedAttention(self.cache, meta, use_kernel=True)
        if self.fused:
            return lambda: fused_decode_logits(self.model, ids, pos, ctx)
        return lambda: self.model.compute_logits(self.model(ids, pos, ctx))

    def run(self, ids: list[int], pos: list[int], slots: list[int], lens: list[int], tables: list[list[int]],
            patch: tuple[list[int], list[int], torch.Tensor] | None = None) -> torch.Tensor:
        """Logits [B, V] of a decode-only batch (replays a graph; captures the ladder on first use). `patch` =
        (rows, source rows, tokens on the device): ids[rows] = tokens[source rows] before the replay."""
        self._ensure_captured()
        B = len(ids)
        size = next(s for s in self.sizes if s >= B)
        self._fill(size, ids, pos, slots, lens, tables, patch)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:B]

    def _ensure_captured(self) -> None:
        if self.graphs:
            return
        try:
            start = time.perf_counter()
            self.capture()
            torch.cuda.synchronize()
            self.capture_s["ladder"] = time.perf_counter() - start
        except Exception as err:  # e.g. a model op that syncs with the host; fall back to eager for good
            warnings.warn(f"CUDA graph capture failed ({'fused' if self.fused else 'module'} forward): {err}")
            self.failed, self.graphs = True, {}
            raise CaptureFailed from err

    def run_steps(self, inputs: tuple[list, ...], patch: tuple[list[int], list[int], torch.Tensor] | None,
                  floats: torch.Tensor, ints: torch.Tensor, flags: dict, want_logprobs: bool, steps: int,
                  sampler, processing: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [X * steps, size], last step's tokens [size]) of `steps` decode steps with sampling in one replay
        (`multistep.decode_steps`); `inputs` as `run` takes them, `floats`/`ints` from `ModelRunner._sampling_host`,
        `processing`: the rows' `logit_processors.processing_fields` on the device, or None. A graph per (size,
        steps, sampling flags, processing fields present), captured on first use."""
        self._ensure_captured()
        B = len(inputs[0])
        size = next(s for s in self.sizes if s >= B)
        present = tuple(name for name, t in (processing or {}).items() if t is not None)
        key = (size, steps, want_logprobs, tuple(sorted(flags.items())), present)
        if key not in self.step_graphs:
            self._fill(size, [], [], [], [], [])  # the warm-up run writes the scratch block only
            try:
                start = time.perf_counter()
                self.step_graphs[key] = self._capture_steps(size, steps, want_logprobs, flags, sampler, present)
                torch.cuda.synchronize()
                self.capture_s[f"steps={steps} size={size}"] = time.perf_counter() - start
            except Exception as err:
                warnings.warn(f"CUDA graph capture of {steps} decode steps failed: {err}")
                raise CaptureFailed from err
        graph, (out, last), floats_2S, ints_1KS, static = self.step_graphs[key]
        for name in present:  # rows past B: penalty 1, nothing seen, min-p 0 (`_capture_steps`' values)
            static[name][:B].copy_(processing[name])
            static[name][B:] = _PROCESSING_PADS[name]
        self._fill(size, *inputs, patch)
        if size > B:  # padding rows: temperature 1, top-p 1, top-k V, key 0
            floats = torch.cat([floats, torch.ones(2, size - B, dtype=floats.dtype)], 1)
            pad = torch.zeros(ints.shape[0], size - B, dtype=ints.dtype)
            pad[0] = self.model.cfg.vocab_size
            ints = torch.cat([ints, pad], 1)
        upload_into(floats_2S, floats)
        upload_into(ints_1KS, ints)
        graph.replay()
        return out, last

    def _capture_steps(self, size: int, steps: int, want_logprobs: bool, flags: dict, sampler,
                       present: tuple[str, ...]) -> tuple:
        ids, pos, slots, lens, tables = self._views(size)
        dev = self.cache.device
        floats_2S = torch.ones(2, size, dtype=torch.float32, device=dev)  # temperatures, top-ps (padding: 1, 1)
        V = self.model.cfg.vocab_size
        ints_1KS = torch.zeros(1 + steps, size, dtype=torch.int64, device=dev)  # top-ks, each step's keys
        ints_1KS[0] = V
        static = {name: torch.full((size, V) if name == "seen_BV" else (size,), _PROCESSING_PADS[name], device=dev,
                                   dtype=torch.bool if name == "seen_BV" else torch.float32) for name in present}
        st = SamplingTensors.packed(floats_2S, ints_1KS, flags, **static)
        sample = step_sampler(sampler, st, ints_1KS[1:], want_logprobs)
        out = torch.zeros((2 if want_logprobs else 1) * steps, size, dtype=torch.float64, device=dev)
        logits = self._forward(size)

        def run():
            last = decode_steps(lambda k: logits(), sample, ids, pos, slots, lens, tables, self.cache.block_size,
                                steps, out)
            return out, last

        graph, outs = self._capture(run)
        return graph, outs, floats_2S, ints_1KS, static


_PROCESSING_PADS = dict(penalties_B=1.0, seen_BV=False, min_ps_B=0.0)  # a padding row's (options off)


def flat_inputs(size: int, max_blocks: int, scratch: int, block_size: int, ids: list[int], pos: list[int],
                slots: list[int], lens: list[int], tables: list[list[int]],
                patch: tuple[list[int], list[int], torch.Tensor] | None) -> tuple[array.array, int]:
    """The staging contents of one step (`DecodeGraphs` layout, padded to `size` rows; then the patch's row lists)
    as an int64 array (5x faster to upload than torch.tensor(list)), and the count before the patch lists.
    Built as one Python list converted once: array.extend(list) goes element by element, 2x slower."""
    pad = size - len(ids)
    flat = ids + [0] * pad + pos + [0] * pad + slots + [scratch * block_size] * pad + lens + [1] * pad
    pads = _pad_lists(scratch, max_blocks)
    for t in tables:
        flat += t
        flat += pads[max_blocks - len(t)]
    flat += [scratch] * (max_blocks * pad)
    n_in = len(flat)
    if patch is not None:
        flat += patch[0]
        flat += patch[1]
    return array.array("q", flat), n_in


@functools.cache
def _pad_lists(scratch: int, max_blocks: int) -> list[list[int]]:
    """[scratch] * k for k = 0..max_blocks: a block table's padding, built once."""
    return [[scratch] * k for k in range(max_blocks + 1)]


class CaptureFailed(RuntimeError):
    pass


class _HostOps(TorchDispatchMode):
    """Records ops that read a host tensor or a device scalar while the forward runs on the device."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        on_host = any(t.device.type == "cpu" and t.dim() > 0 for t in tensors)
        if on_host or "_local_scalar_dense" in str(func):
            frames = [f for f in traceback.extract_stack() if "moeloop" in f.filename and "cuda_graphs" not in f.filename]
            where = f"{frames[-1].filename.split('moeloop/')[-1]}:{frames[-1].lineno}" if frames else "?"
            self.found.append(f"{func} at {where}")
        return func(*args, **(kwargs or {}))


def host_ops(run) -> list[str]:
    """Diagnose a failed capture: the distinct host-touching ops of one eager run of the forward."""
    spy = _HostOps()
    try:
        with spy:
            run()
    except Exception as err:  # report what was seen so far
        spy.found.append(f"(eager run raised {err!r})")
    return sorted(set(spy.found))
