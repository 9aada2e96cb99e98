"""Pipeline parallelism (`parallel.pp`, `parallel.vpp`): each of pp stages holds a contiguous run of the decoder layers
(or vpp runs of them, interleaved), applied to a plain model from outside, before tensor, expert and data parallelism
(which then run within a stage's ranks):

    init_parallel_groups(cp, tp, pp, vpp=v)   # collective: ranks ordered (dp, pp, cp, tp); pp groups across stages
    split_stages(model)                       # this stage's layers (v chunks of them); the first keeps the embedding
    hidden = model(ids, positions, attn)      # stage s receives stage s - 1's activations and sends its own on
    run_passes(micro_batches, micro_loss)     # training: forwards and backwards in 1F1B order across the stages
    for item, out in forward_passes(micro_batches, forward):  # forward-only: all forwards, then the head outputs
    loss = last_stage_value(loss)             # the last stage's loss and metrics, on every stage
    for name, t in gather_stage_weights(it):  # every stage's full weights on every rank (weight sync, HF export)

The stages' ranks hold the same samples (a replica group of pp * cp * tp ranks pools what each generated), pack the
same micro-batches and run the same passes. Activations go forward stage by stage by point-to-point sends inside
autograd (a header with the shape and dtype first, so packed micro-batches of any length pass; sends asynchronous,
receives blocking); the backward runs the other way, each stage receiving the gradient of its output and sending that
of its input (on a second group of the same ranks, so gradients and activations never queue on one channel).
Training passes run in 1F1B order (`run_passes`, `schedule`: Megatron's non-interleaved schedule): stage s runs
pp - 1 - s forwards ahead, then a forward and a backward in turn, so the stages compute at once and stage s holds at
most pp - s micro-batches' activations. Interleaved (`parallel.vpp` = v > 1, Megatron's virtual pipeline): the layers
split into pp * v chunks, chunk k on stage k % pp, and a micro-batch's forward passes the stages v times (the last
stage's chunk c sends to the first stage's chunk c + 1); each stage runs Megatron's interleaved order of chunk passes,
which shrinks the bubble v times. The trainer's pass function runs once for each chunk then (`_in_chunk` makes the
stage's layers iterate as that chunk's, and swaps a receive in for the first stage's embedding and a send for the last
stage's norm where the chunk needs them); `holds_head` says which pass's outputs are real. The last stage alone runs
the final norm, the head and the loss; the other stages' backward takes the next stage's gradient, and their metrics
are the last stage's, sent after the passes. A forward-only pass (old and reference logprobs, values;
`forward_passes`) runs every forward first on each stage (in the interleaved order's forwards under vpp), so the
stages compute at once, then the last stage broadcasts the head's per-position outputs over the pp group.
(torch.distributed.pipelining's stages and schedules take micro-batches of one fixed shape cut from one batch tensor;
the trainer's micro-batches are packed token streams of varying length with per-token loss inputs.)

Names stay the whole model's (`model.layers.<i>`), so DCP checkpoints reshard between pipeline layouts and one process,
and the weight sync and the HF export see the whole model (`gather_stage_weights`).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from moeloop.errors import InputError
from moeloop.parallel.groups import (pipeline_ends_group, pipeline_layout, pp_grad_group, pp_group, pp_peer, pp_rank,
                                     pp_size, vpp_size)

WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # an activation's dtype goes as its index here
Item = TypeVar("Item")
HOST = torch.device("cpu")  # names and shapes go through gloo (on GPUs too: the default group is cpu:gloo,cuda:nccl)


class StageLayers(nn.ModuleDict):
    """A stage's decoder layers under their whole-model indices (`model.layers.<i>` as in the whole model); iterating
    it gives the layers in order, as iterating the whole model's ModuleList does, and inside a pass of an interleaved
    schedule the layers of the model chunk the pass runs."""

    def __init__(self, chunks: list[list[int]], layers: nn.ModuleList):
        super().__init__({str(i): layers[i] for chunk in chunks for i in chunk})
        self.chunks = chunks  # this stage's chunks' layer indices, chunk by chunk

    def __iter__(self):
        chunk = _SCHEDULE.chunk
        if chunk is None or len(self.chunks) == 1:
            return iter(self.values())
        return iter(self[str(i)] for i in self.chunks[chunk])


class StageInput(nn.Module):
    """The embedding's place on a stage after the first: the previous stage's activations for these tokens."""

    def __init__(self, src: int):
        super().__init__()
        self.src = src  # the previous stage's global rank

    def forward(self, input_ids_T: torch.Tensor) -> torch.Tensor:
        # an empty leaf that requires grad puts the receive in the autograd graph, whose backward sends the gradient
        anchor = torch.empty(0, device=input_ids_T.device, requires_grad=torch.is_grad_enabled())
        return _Receive.apply(anchor, self.src, input_ids_T.shape[0])


class StageOutput(nn.Module):
    """The final norm's place on a stage before the last: sends the activations to the next stage and returns zeros
    of their shape, which carry no gradient back (the backward receives the real one from the next stage)."""

    def __init__(self, dst: int):
        super().__init__()
        self.dst = dst

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return _Send.apply(x_TD, self.dst)


_SENDS: list[tuple[Any, torch.Tensor]] = []  # sends in flight and their tensors (kept alive until they complete)


def _isend(x: torch.Tensor, dst: int, group) -> None:
    x = x.contiguous()
    _SENDS.append((dist.isend(x, dst, group=group), x))


def finish_sends() -> None:
    """Wait for every send in flight (`run_passes` does at its end)."""
    for work, _ in _SENDS:
        work.wait()
    _SENDS.clear()


def _send_tensor(x: torch.Tensor, dst: int) -> None:
    if x.dtype not in WIRE_DTYPES:
        raise TypeError(f"pipeline stage output of dtype {x.dtype}: expected one of {WIRE_DTYPES}")
    _isend(torch.tensor([*x.shape, WIRE_DTYPES.index(x.dtype)], dtype=torch.int64, device=x.device), dst, pp_group())
    _isend(x, dst, pp_group())


def _recv_tensor(src: int, device: torch.device) -> torch.Tensor:
    header = torch.empty(3, dtype=torch.int64, device=device)
    dist.recv(header, src, group=pp_group())
    rows, dim, code = header.tolist()
    x = torch.empty(rows, dim, dtype=WIRE_DTYPES[code], device=device)
    dist.recv(x, src, group=pp_group())
    return x


class _Receive(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor: torch.Tensor, src: int, num_rows: int) -> torch.Tensor:
        x_TD = _recv_tensor(src, anchor.device)
        if x_TD.shape[0] != num_rows:
            raise RuntimeError(f"pipeline stage {pp_rank()}: received {x_TD.shape[0]} rows from rank {src} for a "
                               f"micro-batch of {num_rows} tokens (the stages' micro-batches differ)")
        ctx.src = src
        return x_TD

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        _isend(grad_TD, ctx.src, pp_grad_group())
        return None, None, None


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, dst: int) -> torch.Tensor:
        _send_tensor(x_TD.detach(), dst)
        ctx.dst, ctx.shape, ctx.dtype = dst, x_TD.shape, x_TD.dtype
        return torch.zeros_like(x_TD)

    @staticmethod
    def backward(ctx, _unused: torch.Tensor):
        grad_TD = torch.empty(ctx.shape, dtype=ctx.dtype, device=_unused.device)
        dist.recv(grad_TD, ctx.dst, group=pp_grad_group())
        return grad_TD, None


def split_stages(model: nn.Module) -> None:
    """Keep this rank's stage of `model` (in place, before anything shards it): its decoder layers
    (`Layout.stage_chunks` of `parallel.groups.pipeline_layout`: under an interleaved pipeline, vpp runs of them, chunk c the one of the
    model's chunk c * pp + stage); the embedding on the first stage, the final norm and lm_head on the last. The other
    stages' places take a receive and a send, and so do the first stage's chunks after its first (they receive from
    the last stage's chunk before) and the last stage's chunks before its last (they send to the first stage's next)."""
    pp, stage, vpp = pp_size(), pp_rank(), vpp_size()
    layout = pipeline_layout()
    counts = layout.chunk_layers(model.cfg.num_layers)
    if min(counts) < 1:
        raise InputError(f"parallel.pp={pp}, parallel.vpp={vpp}: the model chunks would hold {counts} of the "
                         f"{model.cfg.num_layers} decoder layers; every chunk needs one at least "
                         "(parallel.first_stage_layers / last_stage_layers, parallel.vpp)")
    chunks = [list(run) for run in layout.stage_chunks(model.cfg.num_layers, stage)]
    model.model.layers = StageLayers(chunks, model.model.layers)
    if stage > 0:
        model.model.embed_tokens = StageInput(pp_peer(stage - 1))
    if stage < pp - 1:
        model.model.norm = StageOutput(pp_peer(stage + 1))
        model.lm_head = None
    model.pipeline_stage = stage
    if vpp > 1 and stage in (0, pp - 1):
        # the places a chunk's pass swaps in (`_in_chunk`): the first stage's later chunks receive from the last stage
        model.pipeline_chunk_io = (StageInput(pp_peer(pp - 1)) if stage == 0 else None,
                                   StageOutput(pp_peer(0)) if stage == pp - 1 else None)
        _CHUNKED.add(model)


_CHUNKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models whose first or last stage swaps places by chunk


@contextmanager
def _in_chunk(chunk: int) -> Iterator[None]:
    """A pass of model chunk `chunk` (interleaved schedule): the stage's layers iterate as that chunk's, and a first
    stage's chunk after its first takes a receive for its embedding, a last stage's chunk before its last a send for
    its final norm (put back after the pass)."""
    swapped = []
    if vpp_size() > 1:
        for model in _CHUNKED:
            receive, send = model.pipeline_chunk_io
            for name, place, used in (("embed_tokens", receive, chunk > 0), ("norm", send, chunk < vpp_size() - 1)):
                if place is not None and used:
                    swapped.append((model.model, name, getattr(model.model, name)))
                    setattr(model.model, name, place)
    _SCHEDULE.chunk = chunk
    try:
        yield
    finally:
        _SCHEDULE.chunk = None
        for module, name, home in swapped:
            setattr(module, name, home)


def tied_copy(model: nn.Module) -> nn.Parameter | None:
    """This stage's copy of a head weight tied to the embedding (`ties_head`, which the trainer sets) when the pipeline
    splits the two: the first stage's embedding and the last stage's head are two copies of one weight (Megatron's
    word embeddings on both ends of the pipeline), equal at the start and kept equal by equal gradients. Else None."""
    stage = getattr(model, "pipeline_stage", None)
    if not getattr(model, "ties_head", False) or stage not in (0, pp_size() - 1):
        return None
    return model.model.embed_tokens.weight if stage == 0 else model.lm_head.weight


@torch.no_grad()
def reduce_tied_grads(model: nn.Module) -> None:
    """Before the optimizer step: the embedding's gradient (first stage) and the tied head's (last stage) summed over
    the two, so both copies take the whole gradient of the shared weight and stay equal. (Their FSDP shards line up:
    the stages' meshes are alike.) A no-op without a weight tied across stages."""
    weight = tied_copy(model)
    if weight is None or weight.grad is None:
        return
    grad = weight.grad
    dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=pipeline_ends_group())


def is_last_stage() -> bool:
    return pp_rank() == pp_size() - 1


def holds_head() -> bool:
    """Whether this pass's head outputs are real: no pipeline parallelism, or the last stage running its last chunk
    (a pass's loss and metrics elsewhere are placeholders: record them only where this is true)."""
    if pp_size() == 1:
        return True
    return is_last_stage() and (_SCHEDULE.chunk is None or _SCHEDULE.chunk == vpp_size() - 1)


def stage_outputs(head_fn, hidden_TD: torch.Tensor, outputs: tuple[bool, ...] | None = None):
    """`head_fn(hidden_TD)` on every stage: per-position values, one tensor (`outputs` None) or a tuple of tensors and
    Nones (`outputs` says which are tensors). The last stage computes it. The other stages, where `hidden_TD` is the
    placeholder `StageOutput` returned, get zeros of its shape, as outputs of it whose backward gives it zeros: their
    loss is not used (their backward takes the next stage's gradient, and their metrics are replaced by the last
    stage's, `last_stage_value`), and a forward-only pass's values arrive after its passes (`forward_passes`). So under
    pipeline parallelism a forward runs inside `run_passes` or `forward_passes`."""
    if pp_size() == 1:
        return head_fn(hidden_TD)
    if not _SCHEDULE.running:
        raise RuntimeError("under pipeline parallelism a forward runs inside pipeline.run_passes or forward_passes")
    if holds_head():
        return head_fn(hidden_TD)
    present = (True,) if outputs is None else outputs
    zeros = list(_Placeholders.apply(hidden_TD, sum(present)))
    values = [zeros.pop(0) if p else None for p in present]
    return values[0] if outputs is None else tuple(values)


class _Placeholders(torch.autograd.Function):
    """`count` fp32 zeros of a stage's rows, outputs of its placeholder hidden states (whose gradient they give zeros)."""

    @staticmethod
    def forward(ctx, hidden_TD: torch.Tensor, count: int):
        ctx.shape, ctx.dtype = hidden_TD.shape, hidden_TD.dtype
        return tuple(torch.zeros(hidden_TD.shape[0], dtype=torch.float32, device=hidden_TD.device)
                     for _ in range(count))

    @staticmethod
    def backward(ctx, *grads):
        return torch.zeros(ctx.shape, dtype=ctx.dtype, device=grads[0].device), None


class _Schedule:
    running = False  # inside `run_passes` or `forward_passes`
    chunk: int | None = None  # the model chunk a pass of an interleaved schedule runs (None: outside a pass)


_SCHEDULE = _Schedule()


@contextmanager
def _scheduled() -> Iterator[None]:
    """A stretch of passes: `stage_outputs` gives the stages before the last zeros; the sends complete at its end."""
    _SCHEDULE.running = True
    try:
        yield
    finally:
        _SCHEDULE.running = False
        finish_sends()


Unit = tuple[bool, int, int]  # (a forward, not a backward; micro-batch; model chunk)


def _forward_order(m: int, pp: int, vpp: int, backward: bool = False) -> list[tuple[int, int]]:
    """(micro-batch, chunk) in a stage's order: groups of pp micro-batches, each group through the chunks in turn
    (the backward's chunks last to first); Megatron's interleaved order (one chunk: the micro-batches in turn)."""
    chunks = range(vpp - 1, -1, -1) if backward else range(vpp)
    return [(mb, c) for g in range(0, m, pp) for c in chunks for mb in range(g, min(g + pp, m))]


def _stage_units(m: int, pp: int, vpp: int, warmup: int) -> list[Unit]:
    forwards, backwards = _forward_order(m, pp, vpp), _forward_order(m, pp, vpp, backward=True)
    warmup = min(warmup, len(forwards))
    units = [(True, *u) for u in forwards[:warmup]]
    for f, b in zip(forwards[warmup:], backwards):
        units += [(True, *f), (False, *b)]
    return units + [(False, *b) for b in backwards[len(forwards) - warmup:]]


def _finish_time(schedules: list[list[Unit]] | tuple[tuple[Unit, ...], ...], pp: int, vpp: int) -> float | None:
    """When the last stage is done if every stage runs its units in order, each once what it receives has been sent
    (a forward of chunk k of the pp * vpp, `StageLayers`, takes chunk k - 1's output; a backward its own forward and
    chunk k + 1's input gradient), a chunk's forward taking 1 / vpp and its backward 2 / vpp (balanced stages, free
    sends); None if the stages get stuck. Sends never wait (they are asynchronous), so a schedule that runs through
    here cannot deadlock, whatever the stages' speeds."""
    done: dict[tuple[bool, int, int], float] = {}
    at, free, last = [0] * pp, [0.0] * pp, pp * vpp - 1
    while any(at[s] < len(schedules[s]) for s in range(pp)):
        moved = False
        for s in range(pp):
            if at[s] == len(schedules[s]):
                continue
            forward, mb, c = schedules[s][at[s]]
            k = c * pp + s
            needs = [(True, mb, k - 1)] if forward else [(True, mb, k)] + ([(False, mb, k + 1)] if k < last else [])
            needs = [n for n in needs if n[2] >= 0]
            if all(n in done for n in needs):
                start = max([free[s]] + [done[n] for n in needs])
                free[s] = done[forward, mb, k] = start + (1 if forward else 2) / vpp
                at[s] += 1
                moved = True
        if not moved:
            return None
    return max(free)


@lru_cache(maxsize=256)
def schedule(m: int, pp: int, vpp: int) -> tuple[tuple[Unit, ...], ...]:
    """Each stage's passes for `m` micro-batches (a training step's forwards and backwards), in 1F1B order: stage s
    runs its first `warmup` forwards ahead, then a forward and a backward in turn, then the backwards left. One chunk
    a stage: Megatron's non-interleaved warmup, pp - 1 - s. vpp chunks: Megatron's interleaved one, 2 (pp - 1 - s) +
    (vpp - 1) pp forwards (each of 1/vpp of the stage's layers), all of them when m = pp. With m not a multiple of pp
    the last group is short, and where that would leave the stages stuck (`_finish_time`) every stage's warmup grows
    by one until they are not (at most: all forwards first)."""
    if vpp == 1:
        warmups = [pp - 1 - s for s in range(pp)]
    elif m == pp:
        warmups = [m * vpp] * pp
    else:
        warmups = [2 * (pp - 1 - s) + (vpp - 1) * pp for s in range(pp)]
    while True:
        schedules = [_stage_units(m, pp, vpp, w) for w in warmups]
        if _finish_time(schedules, pp, vpp) is not None:
            return tuple(tuple(units) for units in schedules)
        warmups = [w + 1 for w in warmups]


def schedule_stretch(m: int, pp: int, vpp: int) -> float:
    """How much longer than its compute a training pass of `m` micro-batches takes on `pp` balanced stages in
    `schedule`'s order: (m + pp - 1) / m with one chunk a stage (Megatron's 1F1B bubble), about (m + (pp - 1) / vpp)
    / m interleaved (`moeloop plan`'s update time)."""
    return _finish_time(schedule(m, pp, vpp), pp, vpp) / (3 * m)


def peak_in_flight(m: int, pp: int, vpp: int, stage: int) -> float:
    """The most micro-batches' activations `stage` holds at once in `schedule`'s order, in whole stages' (a chunk's
    pass holds 1 / vpp of them; `moeloop plan`'s activations)."""
    held = peak = 0
    for forward, _, _ in schedule(m, pp, vpp)[stage]:
        held += 1 if forward else -1
        peak = max(peak, held)
    return peak / vpp


def run_passes(passes: Iterable[Item], forward: Callable[[Item], torch.Tensor]) -> None:
    """Each of `passes` through `forward(p)`, which runs a micro-batch's forward and returns its loss, and that loss's
    backward. Without pipeline parallelism in turn. With it in 1F1B order (`schedule`): stage s runs pp - 1 - s
    forwards ahead, then one forward and one backward in turn, then the backwards left, so that each stage computes
    while the others do (at most pp - s micro-batches' activations in flight on stage s, as `moeloop plan` counts).
    Under an interleaved pipeline (vpp chunks a stage) `forward(p)` runs once for each chunk, each time a pass of that
    chunk's layers (`holds_head` says which pass's loss is real), in Megatron's interleaved order. The passes without
    the head compute no real loss (`stage_outputs` gives them zeros): their backward takes the gradient the next
    chunk sends. Sends are asynchronous; they are completed before it returns."""
    if pp_size() == 1:
        for item in passes:
            forward(item).backward()
        return
    items = list(passes)
    losses: dict[tuple[int, int], torch.Tensor] = {}
    with _scheduled():
        for is_forward, mb, chunk in schedule(len(items), pp_size(), vpp_size())[pp_rank()]:
            if is_forward:
                with _in_chunk(chunk):
                    losses[mb, chunk] = forward(items[mb])
            else:
                losses.pop((mb, chunk)).backward()


def forward_passes(passes: Iterable[Item], forward: Callable[[Item], Any]) -> Iterator[tuple[Item, Any]]:
    """(item, forward(item)) for each of `passes`, in a forward-only pass (no grad): `forward` returns the head's
    per-position outputs (a tensor, or a tuple of tensors and Nones). Without pipeline parallelism one at a time, as
    they come. With it, each stage runs all its forwards first, so the stages compute at once (stage s + 1 on a
    micro-batch while stage s goes on to the next), then the last stage broadcasts the outputs (fp32) micro-batch by
    micro-batch into the zeros the other stages got."""
    if pp_size() == 1:
        for item in passes:
            yield item, forward(item)
        return
    items = list(passes)
    outputs: dict[int, Any] = {}
    with _scheduled():
        for mb, chunk in _forward_order(len(items), pp_size(), vpp_size()):
            with _in_chunk(chunk):
                out = forward(items[mb])
            if chunk == vpp_size() - 1:  # (the last chunk's: the head's on the last stage)
                outputs[mb] = out
    done = [(item, outputs[mb]) for mb, item in enumerate(items)]
    src, group = pp_peer(pp_size() - 1), pp_group()
    for item, out in done:
        for v in (out if isinstance(out, tuple) else (out,)):
            if v is not None:
                if v.dtype != torch.float32 or not v.is_contiguous():
                    raise TypeError(f"forward_passes: head outputs are broadcast as contiguous fp32, got {v.dtype}")
                dist.broadcast(v, src=src, group=group)
        yield item, out


def last_stage_value(value: Any) -> Any:
    """`value` as the last pipeline stage has it, on every stage of the pp group (a loss or metrics `run_passes`
    computed: only the last stage's are real); `value` itself without pipeline parallelism."""
    if pp_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=pp_peer(pp_size() - 1), group=pp_group(), device=HOST)
    return box[0]


def gather_recorded_routes(tape) -> None:
    """A route tape that recorded this stage's MoE layers (router replay R2, `model.routes.RouteTape`) gets every
    stage's, by their MoE-layer index (collective over the pp group; a no-op without pipeline parallelism)."""
    if pp_size() == 1 or tape is None or tape.recorded is None:
        return
    parts: list[dict] = [{} for _ in range(pp_size())]
    dist.all_gather_object(parts, {i: t.cpu() for i, t in tape.recorded.items()}, group=pp_group())
    device = next(iter(tape.recorded.values())).device if tape.recorded else HOST
    for part in parts:
        for i, t in part.items():
            tape.recorded.setdefault(i, t.to(device))


def gather_stage_weights(local: Iterator[tuple[str, torch.Tensor]],
                         device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of the whole model on every rank, stage by stage (the whole model's order; under an
    interleaved pipeline a stage's chunks come together, so layers leave that order), from each stage's `local` ones:
    the stage's ranks iterate theirs (FSDP's gathers within the stage) and broadcast each over their pp groups.
    Collective: every rank iterates to the end."""
    if pp_size() == 1:
        yield from local
        return
    group, mine = pp_group(), pp_rank()
    for stage in range(pp_size()):
        src = pp_peer(stage)
        if stage == mine:
            for name, tensor in local:
                header = [(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))]
                dist.broadcast_object_list(header, src=src, group=group, device=HOST)
                dist.broadcast(tensor.to(device).contiguous(), src=src, group=group)
                yield name, tensor
            dist.broadcast_object_list([None], src=src, group=group, device=HOST)
            continue
        while True:
            header = [None]
            dist.broadcast_object_list(header, src=src, group=group, device=HOST)
            if header[0] is None:
                break
            name, shape, dtype = header[0]
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.broadcast(tensor, src=src, group=group)
            yield name, tensor
