"""End-to-end GRPO steps: moeloop vs TRL's GRPOTrainer (transformers generate, no vLLM) on the same job.

    python benchmarks/e2e_vs_trl.py --size small --steps 10 --repeats 3              # CPU, fp32
    python benchmarks/e2e_vs_trl.py --size large --steps 10 --repeats 3
    python benchmarks/e2e_vs_trl.py --size reference --device cuda --steps 10        # H200: bf16, 16x8, 256 tokens

Same random-init Qwen3-MoE and tokenizer, same two-digit-addition prompts in the same order (moeloop's
cursor order, chat template, identical token ids), no KL, no router aux loss, constant lr, grad clip 1.
One step = one generation of prompts x n completions + one optimizer step on both sides. Each
(framework, repeat) runs in its own subprocess, alternating which goes first. Step seconds are wall
time between consecutive step ends; step 1 (warm-up) is left out of the medians. Phases: moeloop's own
time/* metrics; TRL: gen = `_generate` (tokenize, transformers generate, decode), reward = `_calculate_rewards`,
score_other = the rest of `_generate_and_score_completions` (advantages; no old-logprob pass when on-policy),
update_rest = the rest of the step (loss forward, backward, optimizer, logging).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

# Model geometry; small/reference come from moeloop's factory, large is built here.
LARGE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             intermediate_size=1024, num_local_experts=16, num_experts_per_tok=4, moe_intermediate_size=512)


@dataclass(frozen=True)
class Job:
    prompts: int  # per step
    n: int  # completions per prompt
    new_tokens: int  # max (or, with exact_length, exactly) new tokens
    lr: float
    dtype: str
    exact_length: bool  # hold EOS off: every completion is new_tokens long


JOBS = {
    "cpu": Job(prompts=4, n=8, new_tokens=8, lr=1e-4, dtype="float32", exact_length=False),
    "reference": Job(prompts=16, n=8, new_tokens=256, lr=1e-6, dtype="bfloat16", exact_length=True),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=["small", "large", "reference"], default="small")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--job", choices=list(JOBS), help="default: reference for --size reference, else cpu")
    p.add_argument("--prompts", type=int, help="override the job's prompts per step (dry runs)")
    p.add_argument("--new-tokens", type=int, help="override the job's new tokens (dry runs)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="override the job's dtype (dry runs)")
    p.add_argument("--micro-batch-tokens", type=int, default=0,
                   help="moeloop actor.max_tokens_per_micro_batch; 0 = the whole batch (as TRL's one forward), "
                        "on CPU at most 16384 tokens")
    p.add_argument("--decode-steps", type=int, default=0, help="moeloop's rollout.decode_steps (0: its auto)")
    p.add_argument("--rollout-mode", choices=["colocated", "async", "disaggregated"], default="colocated",
                   help="moeloop's rollout.mode; async generates the next batch while this one trains (one step "
                        "off-policy: not the same job as TRL's on-policy step), disaggregated does so in an engine "
                        "process of its own (max_staleness 1), on --rollout-device")
    p.add_argument("--rollout-device", default="", help="moeloop's rollout.device with --rollout-mode disaggregated "
                                                        "('' = its default: cpu, or the next GPU)")
    p.add_argument("--moeloop-set", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra moeloop config override (repeatable), e.g. sync.bucket_bytes=1073741824")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads in each run; 0 = torch's default")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "moeloop_e2e_vs_trl")
    p.add_argument("--frameworks", default="moeloop,trl",
                   help="which to run; one alone prints its numbers without the ratio (e.g. a re-measure of moeloop)")
    p.add_argument("--gen-profile", action="store_true",
                   help="moeloop: profile the third step's generation (wall, engine steps, GPU busy, top kernels); "
                        "that step's time then includes the profiler's")
    p.add_argument("--op-profile", action="store_true",
                   help="CPU: profile steps 3-6 of each run (torch.profiler, ops by self time) and print per step "
                        "the time in GEMMs and attention, the floor that no op-level overhead cut can go under; "
                        "those steps' times then include the profiler's")
    p.add_argument("--only", choices=["moeloop", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    job = JOBS[args.job or ("reference" if args.size == "reference" else "cpu")]
    args.job = replace(job, prompts=args.prompts or job.prompts, new_tokens=args.new_tokens or job.new_tokens,
                       dtype=args.dtype or job.dtype)
    return args


# ---------------------------------------------------------------- model and prompts (shared by both sides)

def make_model(size: str, out: Path) -> Path:
    """Write the seeded random model + tokenizer once; later runs reuse it."""
    if (out / "config.json").exists():
        return out
    from moeloop.model.factory import init_model
    if size != "large":
        return init_model("qwen3_moe", size, out, seed=0)
    import transformers
    from moeloop.model.config import ModelConfig
    from moeloop.model.factory import hf_config_dict
    from moeloop.model.hf_io import save_pretrained
    from moeloop.model.tokenizer import build_tokenizer
    from moeloop.model.transformer import MoEForCausalLM
    raw = {k: v for k, v in hf_config_dict("qwen3_moe", "small").items() if k not in ("transformers_version", "model_type")}
    raw = transformers.AutoConfig.for_model("qwen3_moe", **{**raw, **LARGE}).to_dict()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = MoEForCausalLM(ModelConfig.from_hf_dict(raw, source="qwen3_moe/large"))
    build_tokenizer(out)
    save_pretrained(model, out)
    return out


def step_rows(job: Job, steps: int) -> list[list[dict]]:
    """The rows moeloop's cursor hands out at each step (synthetic:arith, data.seed 0, shuffled)."""
    from moeloop.data import EpochCursor, load_rows
    rows = load_rows(["synthetic:arith"], 0)
    cursor = EpochCursor(len(rows), 0, True)
    return [[rows[i] for i in cursor.take(job.prompts)] for _ in range(steps)]


def prompt_tokens(tokenizer: Any, rows: list[dict], n: int) -> int:
    msgs = [[{"role": "user", "content": r["prompt"]}] for r in rows]
    ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    return n * sum(len(x) for x in ids)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------- moeloop side

def run_moeloop(args: argparse.Namespace, run_dir: Path) -> list[dict]:
    from transformers import AutoTokenizer
    from moeloop.config import load_config
    from moeloop.loop import rl
    from moeloop.loop.generation import RolloutWorker
    from moeloop.loop.metrics import MetricsLogger
    job = args.job
    batch_tokens = job.prompts * job.n * (64 + job.new_tokens)
    whole_batch = batch_tokens if args.device == "cuda" else min(batch_tokens, 16384)
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "examples/tiny.yaml"), [
        f"model.path={args.model_dir}", f"model.dtype={job.dtype}", f"trainer.device={args.device}",
        f"trainer.run_dir={run_dir}", f"trainer.steps={args.steps}", "trainer.val_every=0", "trainer.log=[jsonl]",
        "trainer.seed=0", f"data.train_batch_size={job.prompts}", f"data.max_response_length={job.new_tokens}",
        "data.max_prompt_length=64", "data.val_files=[]", f"rollout.n={job.n}", "rollout.temperature=1.0",
        f"actor.optim.lr={job.lr}", f"actor.ppo_mini_batch_size={job.prompts}",
        f"actor.max_tokens_per_micro_batch={args.micro_batch_tokens or whole_batch}",
        "checkpoint.save_every=0", "algorithm.adv_estimator=grpo", "actor.use_kl_loss=false",
        "checkpoint.save_final=false", "checkpoint.export_hf_final=false", f"rollout.ignore_eos={job.exact_length}",
        f"rollout.decode_steps={args.decode_steps}", f"rollout.mode={args.rollout_mode}",
        f"rollout.max_staleness={int(args.rollout_mode != 'colocated')}",
        # TRL's model is loaded in the job's dtype and its AdamW steps those weights: pure bf16, so moeloop's too
        # (its default keeps fp32 masters; --moeloop-set model.fp32_master_weights=true measures what they cost)
        "model.fp32_master_weights=false",
    ] + ([f"rollout.device={args.rollout_device}"] if args.rollout_device else []) + args.moeloop_set)
    marks: list[float] = []
    prompts_seen: list[list[str]] = []
    build, log, generate = rl.build_components, MetricsLogger.log, RolloutWorker.generate

    def timed_build(*a: Any, **kw: Any) -> Any:
        c = build(*a, **kw)
        sync(args.device)
        marks.append(time.perf_counter())
        return c

    ops = OpProfile(args)

    def timed_log(self: MetricsLogger, step: int, metrics: dict, file: str = "metrics.jsonl") -> None:
        if file == "metrics.jsonl":
            marks.append(time.perf_counter())  # the phase timer already synchronised
            ops.step_ended()
        log(self, step, metrics, file)

    def recorded_generate(self: RolloutWorker, examples: list, *a: Any, **kw: Any) -> list:
        prompts_seen.append([e.prompt_text for e in examples])
        if args.gen_profile and len(prompts_seen) == 3:
            return profiled_generate(self, lambda: generate(self, examples, *a, **kw), args.workdir / "gen-profile.txt",
                                     args.device)
        return generate(self, examples, *a, **kw)

    rl.build_components, MetricsLogger.log, RolloutWorker.generate = timed_build, timed_log, recorded_generate
    rl.run_rl(cfg)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = []
    for i, (rec, rows) in enumerate(zip(records, step_rows(job, args.steps))):
        num_samples = int(rec["batch/samples"])
        out.append(dict(step_s=marks[i + 1] - marks[i], reward=rec["reward/mean"], samples=num_samples,
                        completion_tokens=round(rec["response/len_mean"] * num_samples),
                        prompt_tokens=prompt_tokens(tok, rows, job.n), prompts=prompts_seen[i],
                        phases={k[5:]: v for k, v in rec.items() if k.startswith("time/") and k != "time/step"},
                        skipped=rec.get("skipped_samples_frac", 0.0)))
    return out


# ---------------------------------------------------------------- TRL side

def run_trl(args: argparse.Namespace, run_dir: Path) -> list[dict]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from moeloop.reward.rules import arith_reward
    from moeloop.types import Sample
    job = args.job
    per_step = step_rows(job, args.steps)
    data = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                       for rows in per_step for r in rows])
    now: dict[str, Any] = {"phases": {}}
    out: list[dict] = []

    def reward_fn(prompts: list, completions: list, completion_ids: list, answer: list, **_: Any) -> list[float]:
        """moeloop's arith rule on the completion text."""
        scores = [arith_reward(Sample(prompt_ids=[], response_text=c[0]["content"], ground_truth=a)).score
                  for c, a in zip(completions, answer)]
        now.update(reward=statistics.fmean(scores), samples=len(scores),
                   completion_tokens=sum(len(c) for c in completion_ids),
                   prompts=list(dict.fromkeys(p[-1]["content"] for p in prompts)))
        return scores

    dtype = getattr(torch, job.dtype)
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype)
    gen_kwargs = {"min_new_tokens": job.new_tokens} if job.exact_length else None
    config = GRPOConfig(
        output_dir=str(run_dir), max_steps=args.steps, per_device_train_batch_size=job.prompts * job.n,
        gradient_accumulation_steps=1, num_generations=job.n, num_iterations=1, max_completion_length=job.new_tokens,
        temperature=1.0, learning_rate=job.lr, lr_scheduler_type="constant", warmup_steps=0, beta=0.0,
        router_aux_loss_coef=0.0, bf16=job.dtype == "bfloat16", gradient_checkpointing=False, max_grad_norm=1.0,
        shuffle_dataset=False, seed=0, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        use_cpu=args.device == "cpu", generation_kwargs=gen_kwargs, dataloader_num_workers=0)
    assert config.steps_per_generation == 1 and config.generation_batch_size == job.prompts * job.n

    ops = OpProfile(args)

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a: Any, **kw: Any) -> None:
            sync(args.device)
            now["t"] = time.perf_counter()

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            sync(args.device)
            t = time.perf_counter()
            ph = now["phases"]
            ph["score_other"] = ph.pop("generate_and_score", 0.0) - ph.get("gen", 0.0) - ph.get("reward", 0.0)
            ph["update_rest"] = t - now["t"] - ph["score_other"] - ph.get("gen", 0.0) - ph.get("reward", 0.0)
            rows = per_step[len(out)]
            out.append(dict(step_s=t - now["t"], reward=now["reward"], samples=now["samples"],
                            completion_tokens=now["completion_tokens"], prompt_tokens=prompt_tokens(tok, rows, job.n),
                            prompts=now["prompts"], phases=ph))
            now.update(t=t, phases={})
            ops.step_ended()

    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=config, train_dataset=data,
                          processing_class=tok, callbacks=[StepClock()])
    for name, phase in (("_generate", "gen"), ("_calculate_rewards", "reward"),
                        ("_generate_and_score_completions", "generate_and_score")):
        setattr(trainer, name, _timed(getattr(trainer, name), phase, now, args.device))
    trainer.train()
    return out


def profiled_generate(worker: Any, run: Callable, out: Path, device: str) -> Any:
    """One generation call under the CUDA profiler: wall, engine steps, host seconds inside `Engine.step`, GPU busy."""
    from torch.profiler import ProfilerActivity, profile
    from cuda_kernels import kernel_times
    engine, steps_before, host = worker.engine, worker.engine.num_steps, [0.0]
    step = engine.step

    def timed_step() -> Any:
        t = time.perf_counter()
        result = step()
        host[0] += time.perf_counter() - t
        return result

    engine.step = timed_step
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        result = run()
        sync(device)
        wall = time.perf_counter() - t
    del engine.step
    by_name = kernel_times(prof)  # none on CPU
    busy_ms = sum(sum(v) for v in by_name.values()) / 1e3
    steps = engine.num_steps - steps_before
    lines = [f"generate: wall {wall * 1e3:.1f} ms, {steps} engine steps ({wall / steps * 1e3:.2f} ms/step), "
             f"Engine.step {host[0] * 1e3:.1f} ms, GPU busy {busy_ms:.1f} ms, "
             f"{sum(len(v) for v in by_name.values())} kernels"]
    lines += [f"   {sum(us) / 1e3:8.2f} ms  {name[:100]}" for name, us in list(by_name.items())[:12]]
    if device == "cpu":  # where the host time goes: aten ops by self time
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        lines.append(f"   {sum(e.count for e in ops)} profiled ops, "
                     f"{sum(e.self_cpu_time_total for e in ops) / 1e3:.1f} ms self CPU; top by self time:")
        lines += [f"   {e.self_cpu_time_total / 1e3:8.2f} ms  {e.count:6d} x  {e.key[:90]}" for e in ops[:25]]
    out.write_text("\n".join(lines) + "\n")
    return result


GEMM_OPS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_grouped_mm")


class OpProfile:
    """`--op-profile`: torch.profiler (CPU ops) from the end of step FIRST to the end of step LAST (or the run's
    last), driven by the step-end hooks of either side; writes {steps, wall, ops, gemm, attention, optimizer} in
    seconds per step next to the run's result. GEMM self time barely moves under the profiler (tens of us a
    call); the small ops' does."""
    FIRST, LAST = 2, 6

    def __init__(self, args: argparse.Namespace):
        self.on = bool(args.op_profile) and args.steps > self.FIRST
        self.stop = min(self.LAST, args.steps)
        self.out = args.result.with_suffix(".ops.json") if args.result else None
        self.ended, self.prof, self.t = 0, None, 0.0

    def step_ended(self) -> None:
        if not self.on:
            return
        self.ended += 1
        if self.ended == self.FIRST:
            from torch.profiler import ProfilerActivity, profile
            self.prof = profile(activities=[ProfilerActivity.CPU])
            self.prof.__enter__()
            self.t = time.perf_counter()
        elif self.prof is not None and self.ended == self.stop:
            wall = time.perf_counter() - self.t
            self.prof.__exit__(None, None, None)
            n = self.ended - self.FIRST
            events = self.prof.key_averages()

            def self_s(pick: Callable[[str], bool]) -> float:
                return sum(e.self_cpu_time_total for e in events if pick(e.key)) / 1e6 / n

            self.out.write_text(json.dumps(dict(
                steps=n, wall=wall / n, ops=self_s(lambda k: True), gemm=self_s(lambda k: k in GEMM_OPS),
                attention=self_s(lambda k: "scaled_dot_product" in k or "flash_attention" in k),
                optimizer=self_s(lambda k: "adam" in k.lower()))))
            self.prof = None


def _timed(fn: Callable, phase: str, now: dict, device: str) -> Callable:
    def wrapper(*a: Any, **kw: Any) -> Any:
        sync(device)
        t = time.perf_counter()
        result = fn(*a, **kw)
        sync(device)
        now["phases"][phase] = now["phases"].get(phase, 0.0) + time.perf_counter() - t
        return result
    return wrapper


# ---------------------------------------------------------------- driver and report

def run_child(args: argparse.Namespace, framework: str, repeat: int) -> list[dict]:
    result = args.workdir / f"{args.size}-{framework}-{repeat}.json"
    run_dir = args.workdir / f"run-{args.size}-{framework}-{repeat}"
    subprocess.run(["rm", "-rf", str(run_dir), str(result)], check=True)
    cmd = [sys.executable, __file__, "--only", framework, "--model-dir", str(args.model_dir), "--result", str(result),
           "--run-dir", str(run_dir),           "--size", args.size, "--steps", str(args.steps), "--device", args.device,
           "--prompts", str(args.job.prompts), "--new-tokens", str(args.job.new_tokens), "--dtype", args.job.dtype,
           "--micro-batch-tokens", str(args.micro_batch_tokens), "--threads", str(args.threads), "--workdir", str(args.workdir),
           "--decode-steps", str(args.decode_steps), "--rollout-mode", args.rollout_mode,
           "--rollout-device", args.rollout_device, "--job", "reference" if args.job.exact_length else "cpu"] \
        + [f"--moeloop-set={kv}" for kv in args.moeloop_set] \
        + (["--gen-profile"] if args.gen_profile else []) \
        + (["--op-profile"] if args.op_profile else [])
    env = dict(os.environ)
    if framework == "trl" and args.device == "cuda":  # TRL's trainer refuses a process that sees several GPUs
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{framework} repeat {repeat} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    profile_txt = args.workdir / "gen-profile.txt"
    if args.gen_profile and profile_txt.exists():
        print(f"{framework} repeat {repeat}, step 3 " + profile_txt.read_text(), end="")
        profile_txt.unlink()
    steps = json.loads(result.read_text())
    ops = result.with_suffix(".ops.json")
    if ops.exists():
        steps[-1]["op_profile"] = json.loads(ops.read_text())
        ops.unlink()
    return steps


def summarise(steps: list[dict]) -> dict:
    timed = steps[1:] or steps  # step 1 is warm-up
    if steps[-1].get("op_profile"):  # the profiled steps' times include the profiler's
        timed = [s for i, s in enumerate(steps) if i and not OpProfile.FIRST <= i < OpProfile.LAST] or timed
    step_s = statistics.median(s["step_s"] for s in timed)
    phases = {k: statistics.median(s["phases"].get(k, 0.0) for s in timed) for k in timed[-1]["phases"]}
    return dict(step_s=step_s, first_s=steps[0]["step_s"], samples_per_s=timed[0]["samples"] / step_s,
                tokens_per_s=statistics.median((s["prompt_tokens"] + s["completion_tokens"]) / s["step_s"] for s in timed),
                completion_len=statistics.fmean(s["completion_tokens"] / s["samples"] for s in steps),
                rewards=[s["reward"] for s in steps], phases=phases, op_profile=steps[-1].get("op_profile"),
                save_last_s=steps[-1]["phases"].get("save_checkpoint", 0.0),
                skipped=statistics.fmean(s.get("skipped", 0.0) for s in steps))


def report(args: argparse.Namespace, runs: dict[str, list[dict]]) -> None:
    import transformers
    import trl
    job, cfg = args.job, json.loads((args.model_dir / "config.json").read_text())
    print(f"size={args.size} device={args.device} dtype={job.dtype} steps={args.steps} repeats={args.repeats} "
          f"torch {torch.__version__} transformers {transformers.__version__} trl {trl.__version__}")
    print(f"model: hidden {cfg['hidden_size']}, {cfg['num_hidden_layers']} layers, {cfg['num_local_experts']} experts "
          f"top-{cfg['num_experts_per_tok']}, expert ffn {cfg['moe_intermediate_size']}, heads "
          f"{cfg['num_attention_heads']}/{cfg['num_key_value_heads']}x{cfg['head_dim']}, vocab {cfg['vocab_size']}")
    print(f"threads per run: {args.threads or 'torch default'}; moeloop rollout.mode={args.rollout_mode}")
    print(f"job: {job.prompts} prompts x {job.n} = {job.prompts * job.n} completions, "
          f"{'exactly' if job.exact_length else 'at most'} {job.new_tokens} new tokens, lr {job.lr:g}, no KL")
    print(f"{'repeat':>6} {'framework':>9} {'step_s':>8} {'first_s':>8} {'samples/s':>10} {'tokens/s':>9} {'len':>5}")
    for fw, summaries in runs.items():
        for i, s in enumerate(summaries):
            print(f"{i + 1:>6} {fw:>9} {s['step_s']:8.3f} {s['first_s']:8.3f} {s['samples_per_s']:10.1f} "
                  f"{s['tokens_per_s']:9.0f} {s['completion_len']:5.2f}")
    med = {fw: {k: statistics.median(s[k] for s in ss) for k in ("step_s", "samples_per_s", "tokens_per_s")}
           for fw, ss in runs.items()}
    print("median over repeats:")
    for fw, m in med.items():
        print(f"  {fw:>8}: step {m['step_s']:.3f} s, {m['samples_per_s']:.1f} samples/s, {m['tokens_per_s']:.0f} tokens/s")
    if len(med) == 2:
        ratio = {k: med["moeloop"][k] / med["trl"][k] for k in ("samples_per_s", "tokens_per_s")}
        print(f"  ratio moeloop/trl: samples/s {ratio['samples_per_s']:.2f}x, tokens/s {ratio['tokens_per_s']:.2f}x")
    print("reward curves (per-step mean reward):")
    for fw, summaries in runs.items():
        for i, s in enumerate(summaries):
            print(f"  {fw:>8} r{i + 1}: " + " ".join(f"{r:.3f}" for r in s["rewards"]))
    print("phase breakdown (s/step, median over steps 2.., median over repeats):")
    for fw, summaries in runs.items():
        keys = list(summaries[0]["phases"])
        parts = [f"{k} {statistics.median(s['phases'].get(k, 0.0) for s in summaries):.4f}" for k in keys]
        print(f"  {fw:>8}: " + ", ".join(parts))
    profiled = {fw: [s["op_profile"] for s in ss if s.get("op_profile")] for fw, ss in runs.items()}
    if any(profiled.values()):
        print("op profile (s/step under torch.profiler, steps 3-6, left out of the step medians above; median over "
              "repeats; gemm = mm/bmm/addmm/grouped_mm self time, attention = SDPA self time):")
        for fw, profs in profiled.items():
            if profs:
                print(f"  {fw:>8}: " + ", ".join(f"{k} {statistics.median(p[k] for p in profs):.4f}"
                                                  for k in ("wall", "ops", "gemm", "attention", "optimizer")))
        if len(med) == 2 and profiled["moeloop"]:
            floor = statistics.median(p["gemm"] + p["attention"] for p in profiled["moeloop"])
            print(f"  moeloop's GEMMs + attention alone: {floor:.4f} s/step = TRL's step / "
                  f"{med['trl']['step_s'] / floor:.2f}: the ratio if every other op and all Python took no time")
    if "moeloop" in runs:
        last = statistics.median(s["save_last_s"] for s in runs["moeloop"])
        print(f"  moeloop final-step save_checkpoint (DCP + HF export, not in the medians): {last:.3f} s")
        skipped = statistics.fmean(s["skipped"] for s in runs["moeloop"])
        print(f"  moeloop's update left out {skipped:.1%} of the samples (actor.skip_zero_advantage: zero advantage, "
              f"so zero gradient; --moeloop-set actor.skip_zero_advantage=false trains on all of them as TRL does)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.only:
        if args.threads:
            torch.set_num_threads(args.threads)
        run = run_moeloop if args.only == "moeloop" else run_trl
        args.result.write_text(json.dumps(run(args, args.run_dir)))
        return
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.model_dir = make_model(args.size, args.workdir / f"model-{args.size}")
    frameworks = [fw for fw in ("moeloop", "trl") if fw in args.frameworks.split(",")]
    runs: dict[str, list[dict]] = {fw: [] for fw in frameworks}
    prompts: dict[str, list] = {}
    for repeat in range(args.repeats):
        order = frameworks if repeat % 2 == 0 else frameworks[::-1]
        for fw in order:
            steps = run_child(args, fw, repeat)
            prompts[fw] = [[_user_text(p) for p in step["prompts"]] for step in steps]
            runs[fw].append(summarise(steps))
            print(f"repeat {repeat + 1} {fw}: median step {runs[fw][-1]['step_s']:.3f} s", file=sys.stderr, flush=True)
        if len(prompts) == 2 and prompts["moeloop"] != prompts["trl"]:
            sys.exit(f"prompts differ between frameworks: {prompts['moeloop'][0]} vs {prompts['trl'][0]}")
    report(args, runs)


def _user_text(prompt: str) -> str:
    """The user turn of a rendered moeloop prompt ('<bos><|user|>12+34=\\n<|assistant|>') or a TRL message."""
    return prompt.split("<|user|>")[-1].split("\n")[0]


if __name__ == "__main__":
    main()
