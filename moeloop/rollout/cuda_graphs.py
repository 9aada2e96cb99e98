"""`DecodeGraphs`: CUDA graphs of the decode-only forward (model + lm_head) for a ladder of batch sizes.

Inputs live in static buffers sized for `max_num_seqs`; a batch of B rows replays the smallest captured
size >= B with the extra rows pointed at the KV cache's scratch block (context length 1), so padding
never touches a real sequence. Attention inside the graph is the Triton paged decode kernel (static shapes).
Graphs hold KV and parameter addresses: weights must be updated in place and graphs dropped before sleep.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from moeloop.rollout.kv_cache import KVCache
from moeloop.rollout.paged_attention import AttentionMetadata, PagedAttention


def batch_ladder(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, model: nn.Module, cache: KVCache, max_batch: int, max_blocks_per_seq: int):
        self.model, self.cache = model, cache
        self.sizes = batch_ladder(max_batch)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.failed = False
        rotary = getattr(model, "rotary", None)  # keep RoPE tables on the device: no host copy inside a graph
        if rotary is not None and hasattr(rotary, "inv_freq_R2"):
            rotary.inv_freq_R2 = rotary.inv_freq_R2.to(next(model.parameters()).device)

    def fits(self, batch_size: int) -> bool:
        return not self.failed and batch_size <= self.sizes[-1]

    def clear(self) -> None:
        self.graphs.clear()
        self.pool = None

    def _buffers(self) -> None:
        dev, B, N = self.cache.device, self.sizes[-1], self.max_blocks_per_seq
        self.ids = torch.zeros(B, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(B, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(B, dtype=torch.int64, device=dev)
        self.tables = torch.zeros(B, N, dtype=torch.int32, device=dev)
        self.lens = torch.ones(B, dtype=torch.int32, device=dev)

    def capture(self) -> None:
        self._buffers()
        self.pool = torch.cuda.graph_pool_handle()
        self._reset_padding(0)
        for size in reversed(self.sizes):  # largest first so smaller graphs reuse its pool memory
            meta = AttentionMetadata(self.slots[:size], None, self.tables[:size], self.lens[:size], 0, [])
            ctx = PagedAttention(self.cache, meta, use_kernel=True)
            run = lambda: self.model.compute_logits(self.model(self.ids[:size], self.pos[:size], ctx))
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                run()  # warm-up: triton compile, allocator
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = run()
            self.graphs[size] = (graph, out)

    def _reset_padding(self, start: int) -> None:
        scratch = self.cache.scratch_block
        self.tables[start:].fill_(scratch)
        self.slots[start:] = scratch * self.cache.block_size
        self.lens[start:] = 1
        self.ids[start:] = 0
        self.pos[start:] = 0

    def run(self, ids_B: torch.Tensor, pos_B: torch.Tensor, slots_B: torch.Tensor, tables_BN: torch.Tensor,
            lens_B: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] of a decode-only batch (replays a graph; captures the ladder on first use)."""
        if not self.graphs:
            try:
                self.capture()
            except Exception as err:  # e.g. a model op that syncs with the host; fall back to eager for good
                warnings.warn(f"CUDA graph capture failed, decoding eagerly: {err!r}")
                self.failed, self.graphs = True, {}
                raise CaptureFailed from err
        B = ids_B.shape[0]
        size = next(s for s in self.sizes if s >= B)
        self._reset_padding(B)
        self.ids[:B], self.pos[:B], self.slots[:B], self.lens[:B] = ids_B, pos_B, slots_B, lens_B
        self.tables[:B, :tables_BN.shape[1]] = tables_BN
        graph, out = self.graphs[size]
        graph.replay()
        return out[:B]


class CaptureFailed(RuntimeError):
    pass
