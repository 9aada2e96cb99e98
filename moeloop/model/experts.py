"""Routed experts stored stacked, computed on tokens sorted by expert.

Parameters as in transformers: `gate_up_proj` [E, 2F, D] (= cat[gate, up] on dim 1) and `down_proj` [E, D, F].
The K assignments of every token are sorted by expert id (S = T*K rows), run through one of two
implementations, weighted in fp32 and summed back per token:
- "grouped_mm": one `grouped_mm` per projection over all experts (`torch.nn.functional.grouped_mm`, or
  `torch._grouped_mm` on older torch), offsets = int32 cumsum of the per-expert counts. Needs row strides that
  are multiples of 16 bytes (D and F multiples of 8 in bf16, 4 in fp32); groups may be empty.
- "loop": one pair of matmuls per non-empty expert (one host sync for the counts); any device and dtype.
"auto" takes grouped_mm on CUDA in bf16/fp16 and on CPU where its kernel exists, with aligned dims; else the loop.
On CUDA the gather into sorted order and the weighted sum back run as `expert_rows` kernels (fewer, deterministic
backward passes), and SiLU(gate) * up as one `swiglu_kernel` each way; elsewhere as torch ops. Same math and
rounding points either way.
Other implementations plug in with `register_experts_impl(name, fn)` (the rollout engine's fused decode kernels).
"""
# T tokens, D model dim, F expert ffn dim, E experts, K experts per token, S = T*K sorted assignments
from __future__ import annotations

import functools

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moeloop.model.expert_rows import combine_rows, gather_rows, row_kernels_apply
from moeloop.model.swiglu_kernel import swiglu_kernel, swiglu_kernel_applies

EXPERTS_IMPLS = ("auto", "grouped_mm", "loop")
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_available() -> bool:
    return _grouped_mm is not None


@functools.cache
def cpu_grouped_mm_works() -> bool:
    """Whether this torch has a CPU grouped_mm kernel with backward (2.13 does; older builds may not)."""
    return _grouped_mm_runs("cpu", torch.float32)


@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether grouped_mm runs forward and backward on `device_type` in `dtype` (tried once): CPU has a kernel in
    2.13; CUDA's fast kernel takes bf16, other dtypes depend on the build."""
    return _grouped_mm_runs(device_type, dtype)


def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    if _grouped_mm is None:
        return False
    try:
        with torch.inference_mode(False), torch.enable_grad():  # the first caller may be a no-grad rollout
            x = torch.ones(4, 4, requires_grad=True, device=device_type, dtype=dtype)  # (ones: the global RNG
            w = torch.ones(2, 4, 4, requires_grad=True, device=device_type, dtype=dtype)  # is left as it was)
            offs = torch.tensor([1, 4], dtype=torch.int32, device=device_type)
            _grouped_mm(x, w, offs=offs).square().sum().backward()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def grouped_linear(x_SI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """Rows x_SI sorted by expert (expert e's end at offsets_E[e], int32) times each expert's w_EOI[e]^T: [S, O].
    The weight goes in as an [E, I, O] column-major view: the layout grouped_mm takes without a copy."""
    return _grouped_mm(x_SI, w_EOI.transpose(-2, -1), offs=offsets_E)


class ExpertsFn(Protocol):
    def __call__(self, experts: "Experts", x_TD: torch.Tensor, ids_TK: torch.Tensor,
                 weights_TK: torch.Tensor) -> torch.Tensor: ...


_PLUGGED_IMPLS: dict[str, ExpertsFn] = {}
_OVERRIDES_RUN_IMPLS: set[str] = set()


def register_experts_impl(name: str, fn: ExpertsFn, runs_overrides: bool = False) -> None:
    """Make `name` a valid `Experts.impl`; `fn` returns the combined output [T, D] like `Experts.forward`.
    `runs_overrides`: `fn` computes the experts through `Experts.grouped_over` / `looped_over`, so a subclass that
    overrides them (LoRA's adapted experts) is computed right under it too."""
    if name in EXPERTS_IMPLS:
        raise ValueError(f"experts impl {name!r} is built in")
    _PLUGGED_IMPLS[name] = fn
    if runs_overrides:
        _OVERRIDES_RUN_IMPLS.add(name)


def impl_runs_overrides(name: str) -> bool:
    """Whether impl `name` runs an `Experts` subclass's own computation: the built-in ones (a subclass overrides
    `grouped_over` and `looped_over`) and plugged ones registered as computing through them."""
    return name in EXPERTS_IMPLS or name in _OVERRIDES_RUN_IMPLS


def silu_mul(h_S2F: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of h = cat[gate, up] on the last dim: one Triton kernel each way on CUDA, same bits."""
    if swiglu_kernel_applies(h_S2F):
        return swiglu_kernel(h_S2F)
    gate_SF, up_SF = h_S2F.chunk(2, dim=-1)
    return F.silu(gate_SF) * up_SF


def expert_counts(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert (int64 [E]); scatter_add, not bincount, so there is no host sync."""
    ids_S = ids_TK.reshape(-1)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=ids_TK.device)
    return counts_E.scatter_add_(0, ids_S, torch.ones_like(ids_S))


class Experts(nn.Module):
    def __init__(self, num_experts: int, dim: int, ffn_dim: int, impl: str = "auto"):
        super().__init__()
        self.num_experts, self.dim, self.ffn_dim = num_experts, dim, ffn_dim
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, ffn_dim))
        self.impl = impl

    @property
    def impl(self) -> str:
        return self._impl

    @impl.setter
    def impl(self, name: str) -> None:
        if name not in EXPERTS_IMPLS and name not in _PLUGGED_IMPLS:
            raise ValueError(f"experts_impl={name!r}: must be one of {EXPERTS_IMPLS + tuple(_PLUGGED_IMPLS)}")
        if name == "grouped_mm" and not grouped_mm_available():
            raise ValueError(f"experts_impl='grouped_mm': torch {torch.__version__} has no grouped_mm")
        self._impl = name

    def resolved_impl(self, x_TD: torch.Tensor, impl: str | None = None) -> str:
        """"grouped_mm" or "loop" for rows like x_TD, by `impl` (default: this module's; expert parallelism passes
        the one its local experts run)."""
        impl = self._impl if impl is None else impl
        if impl in ("grouped_mm", "loop"):
            return impl
        aligned = (self.dim * x_TD.element_size()) % 16 == 0 and (self.ffn_dim * x_TD.element_size()) % 16 == 0
        if x_TD.is_cuda:
            fast = x_TD.dtype in (torch.bfloat16, torch.float16) and grouped_mm_available()
        else:  # measured 10-35% faster than the loop for fwd+bwd at the tiny/small/large CPU sizes
            fast = x_TD.device.type == "cpu" and grouped_mm_works("cpu", x_TD.dtype)  # (fp32 and bf16; not fp64)
        return "grouped_mm" if fast and aligned else "loop"

    def forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                counts_E: torch.Tensor | None = None) -> torch.Tensor:
        """`counts_E` = number of assignments per expert (int64, sums to T*K); computed here when None."""
        plugged = _PLUGGED_IMPLS.get(self._impl)
        if plugged is not None:
            return plugged(self, x_TD, ids_TK, weights_TK)
        if counts_E is None:
            counts_E = expert_counts(ids_TK, self.num_experts)
        return self.sorted_forward(x_TD, ids_TK, weights_TK, counts_E)

    def sorted_forward(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, weights_TK: torch.Tensor,
                       counts_E: torch.Tensor) -> torch.Tensor:
        """The built-in path: assignments sorted by expert, grouped_mm or the loop, weighted sum per token."""
        T, K = ids_TK.shape
        perm_S = torch.argsort(ids_TK.reshape(-1), stable=True)  # sorted row -> assignment
        inv_perm_S = torch.empty_like(perm_S)  # assignment -> sorted row
        inv_perm_S[perm_S] = torch.arange(perm_S.numel(), device=perm_S.device)
        kernels = row_kernels_apply(x_TD)
        x_SD = gather_rows(x_TD, perm_S // K, inv_perm_S.view(T, K)) if kernels else x_TD[perm_S // K]
        y_SD = self.computed_over(x_SD, counts_E, self._params(), self.resolved_impl(x_TD))
        if kernels:
            return combine_rows(y_SD, inv_perm_S.view(T, K), weights_TK)
        y_TKD = y_SD[inv_perm_S].view(T, K, self.dim)
        return (y_TKD * weights_TK.float()[..., None]).sum(dim=1).to(x_TD.dtype)

    def computed_over(self, x_SD: torch.Tensor, counts_E: torch.Tensor, params: dict[str, torch.Tensor],
                      impl: str) -> torch.Tensor:
        """Rows sorted by expert (counts_E each) through `grouped_over` or `looped_over` (`impl`, resolved)."""
        if impl == "grouped_mm":
            return self.grouped_over(x_SD, torch.cumsum(counts_E, 0, dtype=torch.int32), params)
        return self.looped_over(x_SD, counts_E, params)

    def _grouped(self, x_SD: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        return self.grouped_over(x_SD, offsets_E, self._params())

    def _params(self) -> dict[str, torch.Tensor]:
        # (by attribute: under fp32 master weights, `train.precision.cast_params`, an attribute reads as its cast)
        return {name: getattr(self, name) for name, _ in self.named_parameters(recurse=False)}

    def grouped_over(self, x_SD: torch.Tensor, offsets_E: torch.Tensor,
                     params: dict[str, torch.Tensor]) -> torch.Tensor:
        """One grouped_mm per projection over the experts `params` stands for (as in `looped_over`); expert e's rows
        end at offsets_E[e] (int32)."""
        h_S2F = grouped_linear(x_SD, params["gate_up_proj"], offsets_E)
        return grouped_linear(silu_mul(h_S2F), params["down_proj"], offsets_E)

    def looped_over(self, x_SD: torch.Tensor, counts_E: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """One pair of matmuls per non-empty expert, `params` standing for this module's stacked parameters (by name):
        its own, or the local experts' rows of them under expert parallelism (`counts_E` then counts those experts)."""
        outs = []
        # unbind once: its backward stacks E grads, where per-expert indexing would zero-fill a full [E, ...] each
        gate_up, down = params["gate_up_proj"].unbind(0), params["down_proj"].unbind(0)
        for e, x_nD in enumerate(x_SD.split(counts_E.tolist())):
            if x_nD.shape[0] == 0:
                continue
            outs.append(F.linear(silu_mul(F.linear(x_nD, gate_up[e])), down[e]))
        return torch.cat(outs) if outs else x_SD.new_zeros(0, self.dim)
