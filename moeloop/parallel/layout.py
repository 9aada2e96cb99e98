"""`Layout(dp, tp, pp, vpp, ep, etp, cp)`: the parallel coordinates of one run and their divisibility rules.

The planner validates it before launch; mesh construction and checkpoint metadata build from the same object.
Expert parallelism follows Megatron's MoE "parallel folding": inside one pipeline stage the dp*cp*tp ranks
that hold the same dense layers are re-cut for the experts into ep*etp*expert_dp ranks, so
    expert_dp = dp * cp * tp / (ep * etp)     and     ep * etp must divide dp * cp * tp.
Dense gradients / optimizer states are reduced and sharded over dp*cp ranks, expert ones over expert_dp.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from moeloop.model.config import ModelConfig


@dataclass(frozen=True)
class BatchInfo:
    """What the layout rules need to know about batching; None = unknown, rule skipped."""

    mini_batch_samples: Optional[int] = None  # samples per optimizer step (ppo_mini_batch_size * rollout.n)


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    etp: int = 1
    cp: int = 1
    first_stage_layers: int = 0  # uneven pipeline (Megatron num_layers_in_first_pipeline_stage); 0 = even split
    last_stage_layers: int = 0   # Megatron num_layers_in_last_pipeline_stage; 0 = even split
    sequence_parallel: bool = False  # under tp: the residual stream and its norms split by rows (Megatron's)

    @classmethod
    def from_section(cls, section: Any, dp: Optional[int] = None) -> "Layout":
        """From a `ParallelSection` (or anything with the same fields); `dp` overrides its dp."""
        names = ("dp", "tp", "pp", "vpp", "ep", "etp", "cp", "first_stage_layers", "last_stage_layers",
                 "sequence_parallel")
        kw = {n: getattr(section, n) for n in names if hasattr(section, n)}
        if dp is not None:
            kw["dp"] = dp
        return cls(**kw)

    def with_world(self, world_size: int) -> Optional["Layout"]:
        """The same model-parallel shape with dp chosen to fill `world_size`; None if it does not divide."""
        mp = self.tp * self.pp * self.cp
        if world_size <= 0 or world_size % mp:
            return None
        return Layout(**{**asdict(self), "dp": world_size // mp})

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def dp_cp(self) -> int:
        """Ranks that hold identical dense weights: dense grads are reduced, dense optimizer states sharded, here."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Ranks that hold identical experts (floor; `validate` reports when it is not a whole number)."""
        return max(1, self.dp * self.cp * self.tp // (self.ep * self.etp))

    @property
    def expert_shards(self) -> int:
        """How many ways one MoE layer's routed-expert weights are split: ep * etp."""
        return self.ep * self.etp

    def stage_layers(self, num_layers: int) -> list[int]:
        """Decoder layers held by each pipeline stage (all virtual chunks of a stage together)."""
        chunks = self.chunk_layers(num_layers)
        return [sum(chunks[stage::self.pp]) for stage in range(self.pp)]

    def chunk_layers(self, num_layers: int) -> list[int]:
        """Decoder layers of each model chunk in the pipeline's order: chunk k (of pp * vpp) is the (k // pp)-th chunk
        of stage k % pp (Megatron's interleaving), and holds the k-th run of layers. Even, the earlier chunks one more
        where they do not divide; where the first or last stage's count is set, that stage's layers split so over its
        vpp chunks and the rest over the other stages' chunks."""
        if self.pp == 1:
            return [num_layers]
        ends = self._set_ends()
        shares = {stage: _even(n, self.vpp) for stage, n in ends.items()}
        shares[None] = _even(num_layers - sum(ends.values()), self._middle_chunks())
        return [shares[k % self.pp if k % self.pp in ends else None].pop(0) for k in range(self.pp * self.vpp)]

    def _set_ends(self) -> dict[int, int]:
        """{stage: its layer count} for the first and last stage where `first_stage_layers` / `last_stage_layers` set it."""
        return {stage: n for stage, n in ((0, self.first_stage_layers), (self.pp - 1, self.last_stage_layers)) if n}

    def _middle_chunks(self) -> int:
        """The model chunks the layers the set ends leave split over: the other stages' vpp each."""
        return (self.pp - len(self._set_ends())) * self.vpp

    def stage_chunks(self, num_layers: int, stage: int) -> list[range]:
        """The decoder layers of `stage`'s chunks, chunk by chunk (one run without interleaving): what the runtime
        keeps there (`parallel.pipeline.split_stages`) and the planner counts."""
        counts = self.chunk_layers(num_layers)
        starts = [sum(counts[:k]) for k in range(len(counts))]
        return [range(starts[k], starts[k] + counts[k]) for k in range(stage, len(counts), self.pp)]

    def validate(self, model_cfg: Optional[ModelConfig] = None, world_size: Optional[int] = None,
                 batch: Optional[BatchInfo] = None) -> list[str]:
        """Every violated rule, in plain words; [] means the layout is usable."""
        errors = self._check_sizes()
        if errors:
            return errors
        if world_size is not None and world_size != self.world_size:
            errors.append(f"world size {world_size} != dp*tp*pp*cp = {self.dp}*{self.tp}*{self.pp}*{self.cp} = {self.world_size}")
        if (self.dp * self.cp * self.tp) % (self.ep * self.etp):
            errors.append(f"ep*etp = {self.ep}*{self.etp} = {self.ep * self.etp} must divide dp*cp*tp = "
                          f"{self.dp}*{self.cp}*{self.tp} = {self.dp * self.cp * self.tp} "
                          "(experts are folded into the data/context/tensor ranks of a stage)")
        if self.vpp > 1 and self.pp == 1:
            errors.append(f"vpp={self.vpp} needs pp > 1")
        if (self.first_stage_layers or self.last_stage_layers) and self.pp == 1:
            errors.append("first_stage_layers/last_stage_layers need pp > 1")
        if self.sequence_parallel and (self.cp > 1 or self.pp > 1):
            errors.append(f"sequence_parallel with cp={self.cp}, pp={self.pp}: the trainer splits the residual stream "
                          "by rows only under tp alone (cp and pp 1)")
        if model_cfg is not None:
            errors += self._model_rules(model_cfg)
        if batch is not None:
            errors += self._batch_rules(batch)
        return errors

    def _check_sizes(self) -> list[str]:
        sizes = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "ep": self.ep, "etp": self.etp, "cp": self.cp}
        errors = [f"{k}={v} must be >= 1" for k, v in sizes.items() if v < 1]
        errors += [f"{k}={v} must be >= 0" for k, v in
                   (("first_stage_layers", self.first_stage_layers), ("last_stage_layers", self.last_stage_layers)) if v < 0]
        return errors

    def _model_rules(self, m: ModelConfig) -> list[str]:
        errors = []
        if m.num_heads % self.tp:
            errors.append(f"num_attention_heads={m.num_heads} % tp={self.tp} != 0")
        elif m.num_heads % (self.tp * self.cp):  # Ulysses: each cp rank attends with 1/cp of a tp shard's heads
            errors.append(f"num_attention_heads={m.num_heads} % (tp*cp) = {m.num_heads} % {self.tp * self.cp} != 0 "
                          f"(context parallelism splits the heads over cp)")
        if not m.is_mla and m.num_kv_heads % self.tp and self.tp % m.num_kv_heads:  # (above: each kv head on tp/G ranks)
            errors.append(f"num_key_value_heads={m.num_kv_heads} % tp={self.tp} != 0 and tp % num_key_value_heads = "
                          f"{self.tp % m.num_kv_heads} != 0 (tp must divide the kv heads or be a multiple of them)")
        if m.intermediate_size and (m.num_experts == 0 or len(m.moe_layers) < m.num_layers) and m.intermediate_size % self.tp:
            errors.append(f"intermediate_size={m.intermediate_size} % tp={self.tp} != 0")
        if m.num_experts:
            if m.num_experts % self.ep:
                errors.append(f"num_experts={m.num_experts} % ep={self.ep} != 0")
            if m.moe_intermediate_size % self.etp:
                errors.append(f"moe_intermediate_size={m.moe_intermediate_size} % etp={self.etp} != 0")
        elif self.ep > 1 or self.etp > 1:
            errors.append(f"ep={self.ep}, etp={self.etp} on a dense model (num_experts=0): both must be 1")
        errors += self._pipeline_rules(m.num_layers)
        return errors

    def _pipeline_rules(self, num_layers: int) -> list[str]:
        """The layers split over the chunks as `chunk_layers` does (unevenly where they do not divide, as the runtime
        does): every chunk needs one at least."""
        if self.pp == 1:
            return []
        first, last = self.first_stage_layers, self.last_stage_layers
        middle_chunks = self._middle_chunks()
        rest = num_layers - first - last
        if rest < 0 or (middle_chunks == 0 and rest):
            return [f"first_stage_layers={first} + last_stage_layers={last} do not fit num_layers={num_layers} with pp={self.pp}"]
        errors = [f"{name}={n} < vpp={self.vpp}: each of the stage's vpp chunks needs one layer at least"
                  for name, n in (("first_stage_layers", first), ("last_stage_layers", last)) if 0 < n < self.vpp]
        if rest < middle_chunks:
            errors.append(f"num_layers={num_layers}: {rest} layers for {middle_chunks} pipeline chunks (pp*vpp = "
                          f"{self.pp}*{self.vpp}{' less the first/last stage' if first or last else ''}): every chunk "
                          "needs one layer at least")
        return errors

    def _batch_rules(self, b: BatchInfo) -> list[str]:
        errors = []
        if b.mini_batch_samples is not None and b.mini_batch_samples < self.dp:
            errors.append(f"samples per mini-batch {b.mini_batch_samples} < dp={self.dp}: some DP ranks get no sample")
        return errors

    def describe(self) -> str:
        s = f"dp{self.dp} tp{self.tp} pp{self.pp} vpp{self.vpp} ep{self.ep} etp{self.etp} cp{self.cp}"
        if self.first_stage_layers or self.last_stage_layers:
            s += f" (first/last stage layers {self.first_stage_layers}/{self.last_stage_layers})"
        if self.sequence_parallel and self.tp > 1:
            s += " sequence-parallel"
        return s

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "world_size": self.world_size, "expert_dp": self.expert_dp}


def _even(n: int, parts: int) -> list[int]:
    """`n` split over `parts`, the earlier parts one more where they do not divide."""
    each, extra = divmod(n, parts) if parts else (0, 0)
    return [each + (1 if i < extra else 0) for i in range(parts)]
