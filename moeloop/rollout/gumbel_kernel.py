"""Gumbel-max sampling in Triton: the sampler's full-vocab draw with its logprob (`gumbel_sample`: S programs per
row work on vocab slices, and the row's last program to finish, `last_arrival`, combines the slices' results), its
draw among ranked top-k candidates (`topk_gumbel_argmax`), and what the top-k draws of `topk_kernel` share with
them: the scores and their bits, the row's log-normaliser, the counters, and multi-step decode's record
(`StepRecord`, written by a draw's last program).

The torch path builds the [B, V] noise in int64 (about 25 elementwise kernels over 8 bytes per entry), takes two
logs, divides, adds and reduces: some 30 kernels and ~2 GB of memory traffic at B=128, V=32000; log_softmax reads
the logits again. Here each row's logits are read once. Same bits as the torch path: the `_mix32` hash in
uint32 (products wrap mod 2**32, the low 32 bits the torch path keeps), the exact 24-bit uniform, libdevice
logf (what torch's CUDA log calls), IEEE division, and the smallest vocab id among equal maxima in every path.
Logprobs are the raw temperature-1 log-softmax, equal to torch's up to fp32 rounding (another summation order).
Shapes: B rows, V vocab, N candidates, S vocab slices (programs) per row.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from moeloop.model import kernel_switch
from moeloop.model.kernel_switch import pdl_args
from moeloop.rollout.decode_kernel import triton, triton_interpreting

SPLITS = 8  # programs per row: one per row left most SMs idle at B <= 128 (~34 us for B=128, V=32000 on the H200)


@dataclass
class StepRecord:
    """Where multi-step decode's step k puts what it sampled (`multistep.record_and_advance`): out_XKB[k] the tokens,
    out_XKB[steps + k] the logprobs (if out has 2 * steps rows), float64; `inputs` = (ids, pos, slots, lens,
    tables, block size) to advance in place for the next step, None at the last step. A one-launch sampler that
    writes all that itself (its row's last program) sets `written`."""
    out_XKB: torch.Tensor
    k: int
    steps: int
    inputs: tuple | None
    written: bool = False

    def kernel_args(self) -> dict:
        """The record keywords of `_gumbel_sample` / `_topk_sample` (their `record_rows` call)."""
        out = self.out_XKB
        args = dict(out_ptr=out, s_out=out.stride(0), rec_k=self.k, rec_steps=self.steps, RECORD=True,
                    HAS_LOGPROBS=out.shape[0] == 2 * self.steps, ADVANCE=self.inputs is not None)
        if self.inputs is not None:
            ids, pos, slots, lens, tables, block_size = self.inputs
            args.update(ids_ptr=ids, pos_ptr=pos, slots_ptr=slots, lens_ptr=lens, tables_ptr=tables,
                        s_tb=tables.stride(0), BLOCK_SIZE=block_size)
        return args


if triton is not None:
    import triton.language as tl
    from triton.language.extra import libdevice

    from moeloop.model.kernel_switch import pdl_launch_next, pdl_wait

    @triton.jit
    def record_next(r, ok, pos_ptr, lens_ptr, tables_ptr, s_tb, BLOCK_SIZE: tl.constexpr, ADVANCE: tl.constexpr):
        """ADVANCE: (position + 1, length + 1, the slot of position + 1 from the block tables) of rows r (mask ok),
        the next step's inputs that `record_rows` stores; else zeros. The one-launch samplers load them in every
        program right after the wait, so that the two dependent loads overlap the draw instead of following it."""
        p = 0
        n = 0
        slot = 0
        if ADVANCE:
            p = tl.load(pos_ptr + r, mask=ok, other=0) + 1
            n = tl.load(lens_ptr + r, mask=ok, other=0) + 1
            blk = tl.load(tables_ptr + r.to(tl.int64) * s_tb + p // BLOCK_SIZE, mask=ok, other=0)
            slot = blk.to(tl.int64) * BLOCK_SIZE + p % BLOCK_SIZE
        return p, n, slot

    @triton.jit
    def record_rows(tok, lp, r, ok, out_ptr, s_out, k, steps, ids_ptr, pos_ptr, slots_ptr, lens_ptr, p, n, slot,
                    HAS_LOGPROBS: tl.constexpr, ADVANCE: tl.constexpr):
        """Multi-step decode's record of rows r (mask ok): out[k, r] = tokens, out[steps + k, r] = logprobs (float64);
        ADVANCE: the next step's inputs in place, ids = tokens, and (p, n, slot) from `record_next` as the positions,
        lengths and slots (`multistep.record_and_advance`'s torch ops)."""
        tl.store(out_ptr + k * s_out + r, tok.to(tl.float64), mask=ok)
        if HAS_LOGPROBS:
            tl.store(out_ptr + (steps + k) * s_out + r, lp.to(tl.float64), mask=ok)
        if ADVANCE:
            tl.store(ids_ptr + r, tok.to(ids_ptr.dtype.element_ty), mask=ok)
            tl.store(pos_ptr + r, p, mask=ok)
            tl.store(lens_ptr + r, n, mask=ok)
            tl.store(slots_ptr + r, slot.to(slots_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def last_arrival(counter_ptr, n):
        """True in the last of the n programs that each call this once on one int32 counter, after their stores:
        a CTA barrier (the program's stores are issued), then an acq_rel atomic at GPU scope, so the last program
        sees the others' stores (read them with .cg loads, from L2). The last one sets the counter back to 0 for
        the next launch. (Folding the decode's split merge and router top-k into their kernels this way measured
        slower on the H200 than PDL-overlapped launches: BENCHMARKS.md, session 10.)"""
        tl.debug_barrier()
        last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == n - 1
        if last:
            tl.store(counter_ptr, 0)
        return last

    @triton.jit
    def safe_offset(m):
        """m with -inf (a max over nothing but -inf) as 0: a safe offset for exp(x - m)."""
        return tl.where(m == float("-inf"), 0.0, m)

    @triton.jit
    def row_log_normaliser(m_ptr, l_ptr, b, S: tl.constexpr, S_PAD: tl.constexpr):
        """(M, log sum_s l_s * exp(m_s - M), the slices' m [S_PAD]) of row b from its S slices' max logit m and sum
        of exp(z - m) (written by other programs of the launch: .cg loads); the raw log-softmax of logit z is
        (z - M) - the second."""
        sp = tl.arange(0, S_PAD)
        m_S = tl.load(m_ptr + b * S + sp, mask=sp < S, other=float("-inf"), cache_modifier=".cg")
        l_S = tl.load(l_ptr + b * S + sp, mask=sp < S, other=0.0, cache_modifier=".cg")
        top_m = safe_offset(tl.max(m_S, 0))
        return top_m, tl.log(tl.sum(l_S * tl.exp(m_S - top_m), 0)), m_S

    @triton.jit
    def _mix32(x):
        """lowbias32 on uint32 (the sampler's `_mix32`)."""
        x = x ^ (x >> 16)
        x = x * tl.full([1], 0x7FEB352D, tl.uint32)
        x = x ^ (x >> 15)
        x = x * tl.full([1], 0x846CA68B, tl.uint32)
        return x ^ (x >> 16)

    @triton.jit
    def gumbel_score(z, v, key, temp, LIBDEVICE: tl.constexpr):
        """z / T - log(-log(u(key, v))) in fp32 for logits z at vocab ids v (the torch path's bits)."""
        h = _mix32(_mix32(key ^ v.to(tl.uint32)) ^ key)
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        if LIBDEVICE:
            gumbel = -libdevice.log(-libdevice.log(u))
        else:
            gumbel = -tl.log(-tl.log(u))
        return tl.math.div_rn(z, temp) + gumbel

    @triton.jit
    def _topk_gumbel(vals_ptr, ids_ptr, keys_ptr, temps_ptr, top_ks_ptr, drop_ptr, out_ptr, N,
                     BLOCK_N: tl.constexpr, HAS_DROP: tl.constexpr, LIBDEVICE: tl.constexpr):
        """Program b: among row b's N candidates (ranked: `ranked_topk`'s values and vocab ids), those of rank <
        top_k (rank 0 always) and not dropped (top-p), the id with the max Gumbel score; the smallest id among
        equal maxima (the rule of every sampling path)."""
        b = tl.program_id(0).to(tl.int64)
        r = tl.arange(0, BLOCK_N)
        ok = r < N
        z = tl.load(vals_ptr + b * N + r, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(ids_ptr + b * N + r, mask=ok, other=0)
        keep = ok & (r < tl.load(top_ks_ptr + b))
        if HAS_DROP:
            keep = keep & (tl.load(drop_ptr + b * N + r, mask=ok, other=1) == 0)
        keep = keep | (r == 0)
        key = tl.load(keys_ptr + b).to(tl.uint32)
        temp = tl.load(temps_ptr + b)
        temp = tl.where(temp > 0, temp, 1.0)
        score = tl.where(keep, gumbel_score(z, v, key, temp, LIBDEVICE), float("-inf"))
        top = tl.max(score, 0)
        tl.store(out_ptr + b, tl.min(tl.where(score == top, v, 2**62), 0))

    @triton.jit
    def _gumbel_sample(logits_ptr, keys_ptr, temps_ptr, score_ptr, zs_ptr, m_ptr, l_ptr, idx_ptr, done_ptr, tokens_ptr,
                       logprobs_ptr, s_lb, V: tl.constexpr, SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr,
                       S: tl.constexpr, S_PAD: tl.constexpr, LIBDEVICE: tl.constexpr, out_ptr=None, s_out=0, rec_k=0,
                       rec_steps=1, ids_ptr=None, pos_ptr=None, slots_ptr=None, lens_ptr=None, tables_ptr=None, s_tb=0,
                       BLOCK_SIZE: tl.constexpr = 1, RECORD: tl.constexpr = False, HAS_LOGPROBS: tl.constexpr = False,
                       ADVANCE: tl.constexpr = False, EARLY: tl.constexpr = False, PDL: tl.constexpr = False):
        """Program (b, s), over vocab ids [s * SPLIT_V, (s + 1) * SPLIT_V) of row b: the max of the Gumbel score
        z / T_b - log(-log(u(key_b, v))) (a greedy row, T = 0: z itself), its first id and the logit there, and
        the slice's max logit and sum of exp(z - max), into score / zs / m / l / idx [B, S]. The row's last program
        (`last_arrival` on done[b]) takes the first slice holding the row's max score (the smallest id among equal
        maxima) and writes its id and raw log-softmax z - M - log(sum_s l_s * exp(m_s - M)).
        LIBDEVICE: logf from libdevice (compiled; the interpreter has no libdevice and uses numpy's log).
        RECORD: that program also writes multi-step decode's record of the row (`record_rows`, `StepRecord`).
        PDL: launched while the logits' kernel runs; nothing is read before its wait (`kernel_switch`). After it,
        every program also loads the record's next inputs (`record_next`) for the last one."""
        pdl_launch_next(PDL, EARLY)
        pdl_wait(PDL, EARLY)
        b = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        key = tl.load(keys_ptr + b).to(tl.uint32)
        temp = tl.load(temps_ptr + b)
        greedy = temp <= 0
        temp = tl.where(greedy, 1.0, temp)
        if RECORD:
            p_next, n_next, slot_next = record_next(b, b >= 0, pos_ptr, lens_ptr, tables_ptr, s_tb, BLOCK_SIZE, ADVANCE)
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_v = tl.zeros([BLOCK_V], tl.int32)
        best_z = tl.zeros([BLOCK_V], tl.float32)
        m = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per lane: the running max logit and sum of exp(z - max)
        l = tl.zeros([BLOCK_V], tl.float32)
        for v0 in range(0, SPLIT_V, BLOCK_V):
            v = split * SPLIT_V + v0 + tl.arange(0, BLOCK_V)
            ok = v < V
            z = tl.load(logits_ptr + b * s_lb + v, mask=ok, other=float("-inf")).to(tl.float32)
            score = tl.where(ok, tl.where(greedy, z, gumbel_score(z, v, key, temp, LIBDEVICE)), float("-inf"))
            better = score > best  # strict: within a lane the earlier vocab id keeps a tie
            best_v = tl.where(better, v, best_v)
            best_z = tl.where(better, z, best_z)
            best = tl.where(better, score, best)
            m_new = tl.maximum(m, z)
            l = l * tl.exp(m - safe_offset(m_new)) + tl.exp(z - safe_offset(m_new))
            m = m_new
        top = tl.max(best, 0)
        first = tl.min(tl.where(best == top, best_v, 2147483647), 0)
        m_s = tl.max(m, 0)
        at = b * S + split
        tl.store(score_ptr + at, top)
        tl.store(zs_ptr + at, tl.sum(tl.where(best_v == first, best_z, 0.0), 0))  # (each lane holds other ids)
        tl.store(idx_ptr + at, first)
        tl.store(m_ptr + at, m_s)
        tl.store(l_ptr + at, tl.sum(l * tl.exp(m - safe_offset(m_s)), 0))
        if last_arrival(done_ptr + b, S):
            sp = tl.arange(0, S_PAD)
            ok = sp < S
            tops = tl.load(score_ptr + b * S + sp, mask=ok, other=float("-inf"), cache_modifier=".cg")
            pick = tl.min(tl.where(tops == tl.max(tops, 0), sp, S_PAD), 0)  # the first slice: the smallest ids
            token = tl.sum(tl.where(sp == pick, tl.load(idx_ptr + b * S + sp, mask=ok, other=0,
                                                        cache_modifier=".cg"), 0), 0)
            z_tok = tl.sum(tl.where(sp == pick, tl.load(zs_ptr + b * S + sp, mask=ok, other=0.0,
                                                        cache_modifier=".cg"), 0.0), 0)
            top_m, log_sum, _ = row_log_normaliser(m_ptr, l_ptr, b, S, S_PAD)
            logprob = (z_tok - top_m) - log_sum
            tl.store(tokens_ptr + b, token.to(tl.int64))
            tl.store(logprobs_ptr + b, logprob)
            if RECORD:
                record_rows(token, logprob, b, b >= 0, out_ptr, s_out, rec_k, rec_steps, ids_ptr, pos_ptr, slots_ptr,
                            lens_ptr, p_next, n_next, slot_next, HAS_LOGPROBS, ADVANCE)


def gumbel_sample(logits_BV: torch.Tensor, keys_B: torch.Tensor, temperatures_B: torch.Tensor,
                  record: StepRecord | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [B] int64, their raw temperature-1 logprobs [B] fp32) of the no-filter Gumbel-max draw (a
    temperature-0 row: the argmax) in one launch; capture-safe. Tokens equal the torch path's;
    logprobs equal torch.log_softmax's up to fp32 rounding (another summation order). `record`: the launch also
    writes multi-step decode's record and next inputs (`StepRecord`), and marks it written."""
    if logits_BV.stride(-1) != 1:
        logits_BV = logits_BV.contiguous()
    B, V = logits_BV.shape
    dev = logits_BV.device
    tokens_B = torch.empty(B, dtype=torch.int64, device=dev)
    logprobs_B = torch.empty(B, dtype=torch.float32, device=dev)
    if not B:
        return tokens_B, logprobs_B
    block_v = 1024
    split_v = block_v * max(1, triton.cdiv(V, block_v * SPLITS))
    S = triton.cdiv(V, split_v)
    stats_4BS = torch.empty(4, B, S, dtype=torch.float32, device=dev)  # best score, its logit, max logit, sum exp
    idx_BS = torch.empty(B, S, dtype=torch.int32, device=dev)
    _gumbel_sample[(B, S)](logits_BV, keys_B.contiguous(), temperatures_B.float().contiguous(), *stats_4BS, idx_BS,
                           row_counters(dev, B), tokens_B, logprobs_B, logits_BV.stride(0),
                           V=V, SPLIT_V=split_v, BLOCK_V=block_v, S=S, S_PAD=max(2, triton.next_power_of_2(S)),
                           LIBDEVICE=not triton_interpreting(), num_warps=4, **launch_extras(logits_BV, record))
    return tokens_B, logprobs_B


def topk_gumbel_argmax(vals_BN: torch.Tensor, ids_BN: torch.Tensor, keys_B: torch.Tensor, temperatures_B: torch.Tensor,
                       top_ks_B: torch.Tensor, drop_BN: torch.Tensor | None = None) -> torch.Tensor:
    """Sampled token ids [B] (int64) among each row's candidates (`Sampler`'s top-k path, one program per row):
    `vals_BN`/`ids_BN` from `ranked_topk`, `drop_BN` the top-p mask (None: no top-p)."""
    B, N = vals_BN.shape
    out_B = torch.empty(B, dtype=torch.int64, device=vals_BN.device)
    if B:
        vals_BN, ids_BN = vals_BN.contiguous(), ids_BN.contiguous()  # any float dtype: widened on load
        drop = drop_BN.to(torch.int8).contiguous() if drop_BN is not None else vals_BN  # unread without HAS_DROP
        _topk_gumbel[(B,)](vals_BN, ids_BN, keys_B.contiguous(), temperatures_B.float().contiguous(),
                           top_ks_B.contiguous(), drop, out_B, N, BLOCK_N=max(16, triton.next_power_of_2(N)),
                           HAS_DROP=drop_BN is not None, LIBDEVICE=not triton_interpreting(), num_warps=4)
    return out_B


# session 13: the one-launch samplers write multi-step decode's record themselves (no `_record_advance` launch;
# MOELOOP_FUSED_RECORD=off: they do not) and are launched with PDL (MOELOOP_SAMPLER_PDL=off: without)
FUSED_RECORD = os.environ.get("MOELOOP_FUSED_RECORD", "on").lower() != "off"
SAMPLER_PDL = os.environ.get("MOELOOP_SAMPLER_PDL", "on").lower() != "off"


def launch_extras(logits_BV: torch.Tensor, record: StepRecord | None) -> dict:
    """A one-launch sampler's PDL keywords (it may start while the logits' kernel runs, and lets the next kernel
    start at once: it reads nothing before its wait, and the next step's first kernel reads only weights before
    its own) and, with `record`, the record keywords (marked written: the launch follows)."""
    extras = dict(EARLY=kernel_switch.PDL_EARLY, **pdl_args(logits_BV, logits_BV.shape[0])) if SAMPLER_PDL else {}
    if record is not None and FUSED_RECORD:
        extras.update(record.kernel_args())
        record.written = True
    return extras


_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def row_counters(device: torch.device, B: int) -> torch.Tensor:
    """B int32 zeros for `last_arrival`, kept per (device, B) and reused: the last program of each row sets its
    counter back to 0, so no launch zeroes them (a memset kernel before every sampler launch otherwise). Made
    fresh inside a CUDA graph capture, where a kept tensor would live in the graph's private pool."""
    device = torch.device(device)
    key = (device, B)
    if key not in _COUNTERS:
        counters = torch.zeros(B, dtype=torch.int32, device=device)
        if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
            return counters
        _COUNTERS[key] = counters
    return _COUNTERS[key]
