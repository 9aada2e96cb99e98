"""`KVCache`: the paged K/V tensors of every layer, sized from a byte budget; freed and re-made by sleep/wake.

Layout per layer: k [num_slots, G, Dk], v [num_slots, G, Dv] with slot = block_id * block_size + offset.
One extra block past `num_blocks` is scratch: padded rows of a CUDA-graph decode batch write there.
MLA models cache the expanded per-head K/V (G = H, Dk != Dv), not the compressed latent.
"""
from __future__ import annotations

import torch

from moeloop.errors import InputError
from moeloop.model.config import ModelConfig


ROUTE_DTYPE = torch.int16  # expert ids of the route buffer (rollout.record_routes)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, record_routes: bool = False) -> int:
    per_token = cfg.num_kv_heads * (cfg.qk_head_dim + cfg.attn_v_head_dim) * cfg.num_layers
    kv = per_token * block_size * torch.empty((), dtype=dtype).element_size()
    routes = len(cfg.moe_layers) * cfg.num_experts_per_tok * torch.empty((), dtype=ROUTE_DTYPE).element_size()
    return kv + (routes * block_size if record_routes else 0)


def kv_budget_bytes(kv_cache_bytes: int, gpu_memory_utilization: float, device: torch.device,
                    cpu_default_bytes: int = 256 << 20) -> int:
    """An explicit byte budget wins; on CUDA otherwise a fraction of the memory free now; on CPU a default."""
    if kv_cache_bytes > 0:
        return kv_cache_bytes
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return int(free_bytes * gpu_memory_utilization)
    return cpu_default_bytes


class KVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str, record_routes: bool = False):
        if num_blocks < 1:
            raise InputError(f"KV budget gives {num_blocks} blocks; need at least 1 "
                             f"({kv_bytes_per_block(cfg, block_size, dtype)} bytes per block)")
        self.num_layers, self.num_kv_heads = cfg.num_layers, cfg.num_kv_heads
        self.k_dim, self.v_dim = cfg.qk_head_dim, cfg.attn_v_head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        self.k: torch.Tensor | None = None  # [L, num_slots, G, Dk]
        self.v: torch.Tensor | None = None
        # record_routes: the experts of each slot's token per MoE layer, [L_moe, num_slots, K] (router replay R3)
        self.route_shape = (len(cfg.moe_layers), cfg.num_experts_per_tok) if record_routes else None
        if self.route_shape is not None and not self.route_shape[0]:
            raise InputError("rollout.record_routes: the model has no MoE layer, so there are no routes to record")
        self.routes: torch.Tensor | None = None
        self.allocate()

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def num_slots(self) -> int:
        return (self.num_blocks + 1) * self.block_size

    @property
    def is_allocated(self) -> bool:
        return self.k is not None

    @property
    def num_bytes(self) -> int:
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes + (0 if self.routes is None else self.routes.nbytes)

    def allocate(self) -> None:
        # zeros, not empty: padded/masked reads must never see NaN garbage (0 * NaN = NaN in the PV product)
        shape = (self.num_layers, self.num_slots, self.num_kv_heads)
        self.k = torch.zeros(*shape, self.k_dim, dtype=self.dtype, device=self.device)
        self.v = torch.zeros(*shape, self.v_dim, dtype=self.dtype, device=self.device)
        if self.route_shape is not None:
            L, K = self.route_shape
            self.routes = torch.zeros(L, self.num_slots, K, dtype=ROUTE_DTYPE, device=self.device)

    def free(self) -> None:
        self.k = self.v = self.routes = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
