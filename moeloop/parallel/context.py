"""Context parallelism (`parallel.cp`, DeepSpeed-Ulysses): each micro-batch's packed token stream split over the cp
ranks of a group, applied to a plain model from outside through its attention context.

    groups.init_parallel_groups(cp)                # collective: cp groups (consecutive ranks at tp 1), dp groups across
    ctx = UlyssesAttention(inner_ctx, num_rows)    # inner: PackedAttention / GatheredAttention over the whole stream
    hidden_UD = ctx.gather(model(*ctx.local(input_ids_U, position_ids_U), ctx))

Everything in a decoder layer but attention works token by token, so each rank runs 1/cp of the stream's rows
(padded to a multiple of cp; the pads are token 0 at position 0 and reach no real row). Attention needs every row
of a sequence: q, k and v go through an all-to-all from (this rank's rows, all heads) to (every row, 1/cp of the
heads), the inner context attends over the whole stream with those heads (packed, causal, compact stream), and a
second all-to-all brings the outputs back to their rows. With fewer key/value heads than cp (GQA), k and v are
repeated to the query heads first. Activations per rank shrink by cp; the weights do not (FSDP shards them over
every rank, the cp ones included).

At tp 1, ranks r*cp .. r*cp + cp - 1 form a cp group and hold the same samples (under tensor parallelism a cp group's
ranks are tp apart, `parallel.groups`): data is sharded over the dp = world / (cp * tp) replica groups, and host-side
sums (`collectives.global_values`) and object gathers run over the dp group of the rank (one rank of each replica
group), so nothing is counted twice.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeloop.errors import InputError
from moeloop.model.routes import RouteTape
from moeloop.parallel.collectives import all_gather_rows, all_to_all
from moeloop.parallel.groups import cp_group, cp_rank, cp_size


def check_heads(num_heads: int, cp: int, tp: int = 1) -> None:
    if num_heads % (cp * tp):
        of = f"parallel.cp={cp} x parallel.tp={tp}" if tp > 1 else f"parallel.cp={cp}"
        raise InputError(f"{of} must divide the model's {num_heads} attention heads (Ulysses splits each tp rank's "
                         "heads over the cp ranks)")


class UlyssesAttention:
    """An attention context for this rank's 1/cp of a stream's `num_rows` rows around `inner`, a context over the
    whole stream (see the module docstring). `local` gives the rows the model runs here, `gather` every rank's
    output rows back in stream order."""

    def __init__(self, inner: Any, num_rows: int):
        self.inner, self.num_rows = inner, num_rows
        self.cp, self.group, self.rank = cp_size(), cp_group(), cp_rank()
        self.rows = max(1, math.ceil(num_rows / self.cp))  # per rank
        self.pad, self.lo = self.cp * self.rows - num_rows, self.rank * self.rows  # the pads after the last row; ours
        self.routes: RouteTape | None = None  # this rank's rows of a route tape (`local_routes`)

    def local(self, *row_tensors: torch.Tensor) -> list[torch.Tensor]:
        """This rank's block of each [num_rows] tensor, zero-padded to cp x rows."""
        return [F.pad(t, (0, self.pad))[self.lo:self.lo + self.rows] for t in row_tensors]

    def local_routes(self, tape: RouteTape | None) -> RouteTape | None:
        """A tape over this rank's rows for a tape over the stream's: its replayed ids sliced (the pads route
        afresh), recording if it records (`gather_recorded` then fills the stream's tape)."""
        if tape is None:
            return None
        replay, valid = tape.replay_LTK, tape.valid_T
        if replay is not None:
            replay = F.pad(replay, (0, 0, 0, self.pad))[:, self.lo:self.lo + self.rows]
            if valid is None:
                valid = torch.ones(self.num_rows, dtype=torch.bool, device=replay.device)
            valid = F.pad(valid, (0, self.pad), value=False)[self.lo:self.lo + self.rows]
        return RouteTape(replay, valid, record=tape.recorded is not None)

    def gather_recorded(self, tape: RouteTape | None) -> None:
        """The ids every rank's rows recorded (`self.routes`), in stream order, into `tape`'s record."""
        if tape is None or tape.recorded is None:
            return
        for moe_index, ids_UK in self.routes.recorded.items():
            parts = [torch.empty_like(ids_UK) for _ in range(self.cp)]
            dist.all_gather(parts, ids_UK.contiguous(), group=self.group)
            tape.recorded[moe_index] = torch.cat(parts)[:self.num_rows]

    def gather(self, x_UX: torch.Tensor) -> torch.Tensor:
        """Every rank's output rows in stream order, without the pads (differentiable)."""
        return all_gather_rows(x_UX, self.group)[:self.num_rows]

    def attend(self, layer_idx: int, q_UHD: torch.Tensor, k_UGD: torch.Tensor, v_UGDv: torch.Tensor,
               scale: float) -> torch.Tensor:
        H, G = q_UHD.shape[1], k_UGD.shape[1]
        if G % self.cp:  # fewer kv heads than ranks: each rank takes the kv head of its query heads
            k_UGD, v_UGDv = (x.repeat_interleave(H // G, dim=1) for x in (k_UGD, v_UGDv))
        q, k, v = (self._to_heads(x)[:self.num_rows] for x in (q_UHD, k_UGD, v_UGDv))
        o_PhDv = self.inner.attend(layer_idx, q, k, v, scale)
        o_PhDv = F.pad(o_PhDv, (0, 0, 0, 0, 0, self.pad))
        return self._to_rows(o_PhDv)

    def _to_heads(self, x_UHD: torch.Tensor) -> torch.Tensor:
        """[rows, H, D] here -> [cp x rows, H / cp, D]: every rank's rows, this rank's block of heads."""
        U, H, D = x_UHD.shape
        send = x_UHD.reshape(U, self.cp, H // self.cp, D).transpose(0, 1).reshape(self.cp * U, -1)
        splits = [U] * self.cp
        return all_to_all(send, splits, splits, self.group).view(self.cp * U, H // self.cp, D)

    def _to_rows(self, o_PhD: torch.Tensor) -> torch.Tensor:
        """The inverse of `_to_heads`: [cp x rows, H / cp, D] -> [rows, H, D]."""
        P, h, D = o_PhD.shape
        U = P // self.cp
        splits = [U] * self.cp
        got = all_to_all(o_PhD.reshape(P, h * D), splits, splits, self.group)  # from rank j: my rows, heads block j
        return got.view(self.cp, U, h, D).transpose(0, 1).reshape(U, self.cp * h, D)
