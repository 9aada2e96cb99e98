"""Host-side reductions over the data-parallel ranks: what the loop, the trainer and the advantage estimators sum
(or max) across ranks so that N ranks compute what one process would."""
from __future__ import annotations

import torch
import torch.distributed as dist


def global_values(values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
    """`values` reduced over the DP ranks with `op`, in float64 (as they are in one process). Collective under DP."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return t.tolist()
