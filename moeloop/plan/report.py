"""Plain-text tables of a `Plan`, in the order a reader checks them: model, layout, memory, split, time."""
from __future__ import annotations

from moeloop.plan.build import Plan
from moeloop.plan.memory import GB
from moeloop.plan.split import SplitRow


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _num(x: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def render(plan: Plan) -> str:
    parts = [_model(plan), _layout(plan), _memory(plan), _pipeline(plan), _split(plan), _time(plan), _checkpoint(plan),
             "## assumptions\n" + "\n".join(f"- {a}" for a in plan.assumptions)]
    return "\n\n".join(p for p in parts if p) + "\n"


def _model(plan: Plan) -> str:
    s, seq = plan.stats, plan.seq_tokens
    rows = [["total params", _num(s.total_params)], ["active params / token", _num(s.active_params)],
            ["dense params", _num(s.dense_params)], ["routed-expert params", _num(s.expert_params)]]
    if s.model is not None:
        rows += [[f"forward FLOPs / token (seq {seq})", _num(s.forward_flops_per_token(seq))],
                 [f"train FLOPs / token (seq {seq})", _num(s.train_flops_per_token(seq))],
                 ["KV cache bytes / token" + (" (MLA latent)" if s.model.is_mla else ""), f"{s.kv_bytes_per_token():,}"]]
        if s.model.is_mla:
            rows.append(["  (per-head K/V if expanded)", f"{s.expanded_kv_bytes_per_token():,}"])
    return "## model\n" + table(["quantity", "value"], rows)


def _layout(plan: Plan) -> str:
    lay = plan.layout
    head = (f"## layout\n{lay.describe()}  world={lay.world_size}  expert_dp={lay.expert_dp}  "
            f"pool={plan.pool_gpus} GPUs")
    if not plan.problems:
        return head + "\nall divisibility rules hold"
    return head + "\nVIOLATED:\n" + "\n".join(f"- {p}" for p in plan.problems)


def _memory(plan: Plan) -> str:
    led = plan.ledger
    if led is None:
        return "## memory per rank\n(not computed: fix the layout first)"
    rows = [[k, f"{v / GB:.2f}", "given" if k in led.given else ""] for k, v in led.entries.items()]
    phases = [[p, " + ".join(led.phases[p]), f"{led.phase_bytes(p) / GB:.2f}"] for p in led.phases]
    alts = "\n".join(f"- with {k}: peak {v:.2f} GB" for k, v in plan.alternatives_gb.items())
    return (f"## memory per rank (worst pipeline stage: {led.stage})\n"
            + table(["entry", "GB", ""], rows) + "\n\n" + table(["phase", "entries", "GB"], phases)
            + f"\n\npeak {led.peak_bytes / GB:.2f} GB in phase '{led.peak_phase}': {plan.gpu_verdict}"
            + f"\nCPU for offload: {led.cpu_bytes_per_rank / GB:.1f} GB/rank, {led.cpu_bytes_per_node / GB:.1f} GB/node: "
            + plan.cpu_verdict + ("\n" + alts if alts else ""))


def _pipeline(plan: Plan) -> str:
    """Under parallel.pp: each stage's layers, the activations it holds at once and its peak, and the update's bubble."""
    if not plan.pipeline:
        return ""
    rows = [[str(r["stage"]), ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in r["layers"]) or "-",
             f"{r['in_flight']:.2f}", f"{r['peak_gb']:.2f}"] for r in plan.pipeline]
    first = plan.pipeline[0]
    return (f"## pipeline (pp {plan.layout.pp} x vpp {plan.layout.vpp}, {first['micro_batches']} micro-batches a "
            f"mini-batch per stage)\n"
            + table(["stage", "decoder layers", "micro-batches in flight", "peak GB"], rows)
            + f"\nbubble: the stages wait {first['bubble']:.1%} of the update's compute (1F1B"
            + (f", interleaved over {plan.layout.vpp} chunks a stage)" if plan.layout.vpp > 1 else ")"))


def _split_cells(r: SplitRow) -> list[str]:
    who = f"{r.train_gpus}" + (" (colocated)" if r.colocated else "")
    if r.ledger is None or r.layout is None:
        return [who, str(r.rollout_gpus), "-", "-", "-", "-", "-", "-", "; ".join(r.problems)[:60], "-"]
    led, dec = r.ledger, r.decode
    tok = f"{dec.tokens_per_s:,.0f} (B={dec.batch}; B=1: {dec.tokens_per_s_batch1:,.0f})" if dec else "-"
    roll = f"{led.phase_bytes('rollout') / GB:.1f}" if "rollout" in led.phases else "-"
    return [who, str(r.rollout_gpus), str(r.layout.dp), str(r.layout.expert_dp), f"{led.entries['optimizer'] / GB:.2f}",
            f"{led.resident_bytes / GB:.1f}", f"{r.train_peak_bytes / GB:.1f}", roll, r.verdict, tok]


def _split(plan: Plan) -> str:
    header = ["train GPUs", "rollout GPUs", "DP", "expert DP", "optimizer GB", "resident GB", "train peak GB",
              "rollout-phase GB", "fits?", "decode tok/s (roofline)"]
    return "## colocate vs split\n" + table(header, [_split_cells(r) for r in plan.split])


def _time(plan: Plan) -> str:
    sync = [[k, f"{v:.2f}"] for k, v in plan.sync_s.items()]
    step = plan.step_s
    phases = [[k, f"{v:.1f}", f"{(v / step if step else 0):.1%}"] for k, v in plan.phases_s.items()]
    return (f"## weight sync ({plan.sync_bytes / GB:.1f} GB bf16 per sync)\n" + table(["transport", "seconds"], sync)
            + "\n\n## step time (model)\n" + table(["phase", "seconds", "share"], phases)
            + f"\nstep {step:.1f} s")


def _checkpoint(plan: Plan) -> str:
    c = plan.checkpoint
    return (f"## checkpoint (Young/Daly)\nstate {c['state_gb']:.1f} GB, save {c['save_s']:.0f} s, MTBF {c['mtbf_s'] / 3600:.1f} h "
            f"-> every {c['interval_s']:.0f} s = {c['save_every_steps']:.0f} steps (overhead ~{c['overhead']:.1%})")
