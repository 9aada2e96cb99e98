"""The top-k Gumbel-max draws in Triton: the whole top-k draw, with or without top-p, with its logprob
(`topk_sample`), and the ranked top-n candidates of each row (`ranked_candidates`, for a top-k above the sampler's
FUSED_TOPK_MAX, drawn from by `gumbel_kernel.topk_gumbel_argmax`). Each is one launch of two phases (`_SlicePlan`):
S programs per row each keep the tokens of their vocab slice at or above a bound (the k-th largest of the slice's
group maxima, or its exact top-k by bisection on an order key), and the row's last program to finish
(`last_arrival`) bisects for the row's top-k among them and draws, with `gumbel_kernel`'s scores and bits.
Top-k is a total order: tokens ranked by (logit descending, vocab id ascending), the first k kept (the sampler's
`ranked_topk`), so the candidate set never depends on how a radix select breaks ties.
Shapes: B rows, V vocab, N candidates, S vocab slices (programs) per row, C candidates kept per slice.
"""
from __future__ import annotations

import os

import torch

from moeloop.rollout.decode_kernel import triton, triton_interpreting
from moeloop.rollout.gumbel_kernel import StepRecord, launch_extras, row_counters

if triton is not None:
    import triton.language as tl

    from moeloop.model.kernel_switch import pdl_launch_next, pdl_wait
    from moeloop.rollout.gumbel_kernel import (gumbel_score, last_arrival, record_next, record_rows,
                                               row_log_normaliser, safe_offset)

    @triton.jit
    def _order_key(z, KEY_BITS: tl.constexpr):
        """int32 keys ordered as the fp32 values z (-0.0 equals +0.0). KEY_BITS 16: the top 16 bits only, exact for
        bf16 values (the low 16 bits of a widened bf16 are zero), so 16 bisection steps find any value."""
        bits = z.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negative floats: larger magnitude, smaller key
        key = tl.where(z == 0.0, 0, key)
        if KEY_BITS == 16:
            key = key >> 16
        return key

    @triton.jit
    def _bisect(key, valid, k, lo, hi):
        """One bisection step of `_kth_largest` on [lo, hi]."""
        mid = lo + (hi - lo + 1) // 2
        enough = tl.sum((valid & (key >= mid.to(tl.int32))).to(tl.int32), 0) >= k
        return tl.where(enough, mid, lo), tl.where(enough, hi, mid - 1)

    @triton.jit
    def _kth_largest(key, valid, k, KEY_BITS: tl.constexpr, SHORT: tl.constexpr = False, lo_bound=None):
        """The k-th largest key among the valid lanes (the smallest one when fewer than k are valid): bisection
        for the largest t with count(key >= t) >= k over [min, max], a range of at most 2**KEY_BITS (int64
        bounds: the fp32 range has 2**32 keys). SHORT: stop once the range is one key (log2 of the range steps,
        not KEY_BITS), from lo_bound if given (a key at or below the answer, with k valid lanes at or above it)."""
        lo = tl.min(tl.where(valid, key, 2147483647), 0).to(tl.int64)
        hi = tl.max(tl.where(valid, key, -2147483648), 0).to(tl.int64)
        if SHORT:
            if lo_bound is not None:
                lo = tl.maximum(lo, lo_bound.to(tl.int64))
            while lo < hi:
                lo, hi = _bisect(key, valid, k, lo, hi)
        else:
            for _ in range(KEY_BITS):
                lo, hi = _bisect(key, valid, k, lo, hi)
        return lo.to(tl.int32)

    @triton.jit
    def _keep_first(z, valid, k, KEY_BITS: tl.constexpr, SHORT: tl.constexpr = False, full_S=None,
                    S_PAD: tl.constexpr = 1, C: tl.constexpr = 1):
        """Mask of the first k valid lanes under (z descending, lane ascending): every lane above the k-th largest
        value, then the first lanes tied at it. Lanes are in vocab id order, so this is the top-k total order.
        SHORT: `_kth_largest`'s short bisection; with full_S (the lanes are S_PAD slices of C candidates, full_S
        marks the slices that kept k), it starts at the largest of those slices' smallest kept key: that slice
        alone has k candidates at or above it, so the row's k-th largest is not below it."""
        key = _order_key(z, KEY_BITS)
        lo_bound = None
        if full_S is not None:
            slice_min = tl.min(tl.reshape(tl.where(valid, key, 2147483647), (S_PAD, C)), 1)
            lo_bound = tl.max(tl.where(full_S, slice_min, -2147483648), 0)
        kth = _kth_largest(key, valid, k, KEY_BITS, SHORT, lo_bound)
        above = valid & (key > kth)
        tie = valid & (key == kth)
        room = k - tl.sum(above.to(tl.int32), 0)
        return above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= room))

    @triton.jit
    def _compact(keep, z, v, vals_ptr, ids_ptr):
        """Store the kept lanes' (value, vocab id) densely, in lane order (the caller counts them)."""
        pos = tl.cumsum(keep.to(tl.int32), 0) - 1
        tl.store(vals_ptr + pos, z, mask=keep)
        tl.store(ids_ptr + pos, v, mask=keep)

    @triton.jit
    def _group_bound(z, k, G: tl.constexpr, BLOCK_V: tl.constexpr):
        """The k-th largest of the maxima of G groups of consecutive lanes of z [BLOCK_V] (-inf when fewer than k
        are finite): k groups each hold a value at or above it, so it does not exceed the k-th largest of z. Every
        pair of maxima is compared at once ([G, G], one reduction) where a bisection takes one per key bit."""
        gm = tl.max(tl.reshape(z, (G, BLOCK_V // G)), 1)
        at_or_above = tl.sum((gm[None, :] >= gm[:, None]).to(tl.int32), 1)  # per group: the maxima >= its own
        return tl.max(tl.where(at_or_above >= k, gm, float("-inf")), 0)

    @triton.jit
    def _slice_candidates(logits_ptr, m_ptr, l_ptr, cnt_ptr, cand_z_ptr, cand_v_ptr, b, s, k, s_lb,
                          V: tl.constexpr, S: tl.constexpr, BLOCK_V: tl.constexpr, C: tl.constexpr,
                          KEY_BITS: tl.constexpr, l64_ptr=None, TOP_P: tl.constexpr = False,
                          SHORT: tl.constexpr = False, GROUPS: tl.constexpr = 0):
        """Phase 1 of program (b, s): the slice's max m and sum of exp(z - m) (the logprob's normaliser) and its
        first min(k, n) tokens under the total order, into cand [B, S, C] in vocab id order. A token of the row's
        top-k has fewer than k tokens ahead of it in its own slice, so the slices' candidates hold the top-k.
        TOP_P: also the sum of exp(z - m) in fp64 into l64 (the nucleus mass's normaliser, `_pick_token_top_p`).
        SHORT: the short bisection (`_kth_largest`). GROUPS > 0: the candidates are every token at or above the
        slice's `_group_bound` instead, a superset of its first k (at least k of them), when at most C are; the
        first k when more are (ties, flat rows)."""
        v = s * BLOCK_V + tl.arange(0, BLOCK_V)
        ok = v < V
        z = tl.load(logits_ptr + b * s_lb + v, mask=ok, other=float("-inf")).to(tl.float32)
        m = tl.max(z, 0)
        l = tl.sum(tl.exp(z - safe_offset(m)), 0)
        at = b * S + s
        if TOP_P:
            tl.store(l64_ptr + at, tl.sum(tl.exp(z.to(tl.float64) - safe_offset(m).to(tl.float64)), 0))
        if GROUPS > 0:
            keep = ok & (z >= _group_bound(z, k, GROUPS, BLOCK_V))
            if tl.sum(keep.to(tl.int32), 0) > C:
                keep = _keep_first(z, ok, k, KEY_BITS, SHORT)
        else:
            keep = _keep_first(z, ok, k, KEY_BITS, SHORT)
        n = tl.sum(keep.to(tl.int32), 0)
        _compact(keep, z, v, cand_z_ptr + at * C, cand_v_ptr + at * C)
        tl.store(m_ptr + at, m)
        tl.store(l_ptr + at, l)
        tl.store(cnt_ptr + at, n)

    @triton.jit
    def _row_candidates(cnt_ptr, cand_z_ptr, cand_v_ptr, b, S: tl.constexpr, S_PAD: tl.constexpr, C: tl.constexpr,
                        ALL_SLOTS: tl.constexpr = False):
        """Row b's slice candidates as one [S_PAD * C] vector in vocab id order (written by other programs of the
        launch: .cg loads): (lane index, valid, value (-inf if not), vocab id). ALL_SLOTS (`TOPK_READS_EARLY`): every
        slot is read at once with the counts and the unused ones are masked after, instead of reading only the
        counted ones, whose mask waits for the counts: one L2 round trip instead of two. The same values."""
        j = tl.arange(0, S_PAD * C)
        js = j // C
        valid = (js < S) & (j % C < tl.load(cnt_ptr + b * S + js, mask=js < S, other=0, cache_modifier=".cg"))
        if ALL_SLOTS:
            z = tl.where(valid, tl.load(cand_z_ptr + b * S * C + j, mask=js < S, other=0.0, cache_modifier=".cg"),
                         float("-inf"))
            v = tl.where(valid, tl.load(cand_v_ptr + b * S * C + j, mask=js < S, other=0, cache_modifier=".cg"), 0)
        else:
            z = tl.load(cand_z_ptr + b * S * C + j, mask=valid, other=float("-inf"), cache_modifier=".cg")
            v = tl.load(cand_v_ptr + b * S * C + j, mask=valid, other=0, cache_modifier=".cg")
        return j, valid, z, v

    @triton.jit
    def _row_keep_first(z, valid, k, cnt_ptr, b, S: tl.constexpr, S_PAD: tl.constexpr, C: tl.constexpr,
                        KEY_BITS: tl.constexpr, SHORT: tl.constexpr):
        """`_keep_first` over row b's slice candidates (`_row_candidates`); SHORT: from the full slices' bound."""
        if SHORT:
            sp = tl.arange(0, S_PAD)
            full_S = tl.load(cnt_ptr + b * S + sp, mask=sp < S, other=0, cache_modifier=".cg") >= k
            return _keep_first(z, valid, k, KEY_BITS, True, full_S, S_PAD, C)
        return _keep_first(z, valid, k, KEY_BITS)

    @triton.jit
    def _draw_store(z, v, keep, lane, LANES: tl.constexpr, key, temp, tokens_ptr, logprobs_ptr, b, top_m, log_sum,
                    LIBDEVICE: tl.constexpr):
        """Row b's draw among the kept lanes (lanes in vocab id order) with its key (uint32) and temperature: the max
        Gumbel score (T = 0: the max logit), the first lane among equal maxima (the smallest id); stores and
        returns its id and raw log-softmax z - M - log_sum."""
        score = tl.where(temp > 0, gumbel_score(z, v, key, tl.where(temp > 0, temp, 1.0), LIBDEVICE), z)
        score = tl.where(keep, score, float("-inf"))
        first = tl.min(tl.where(score == tl.max(score, 0), lane, LANES), 0)
        token = tl.sum(tl.where(lane == first, v, 0), 0).to(tl.int64)
        logprob = (tl.sum(tl.where(lane == first, z, 0.0), 0) - top_m) - log_sum
        tl.store(tokens_ptr + b, token)
        tl.store(logprobs_ptr + b, logprob)
        return token, logprob

    @triton.jit
    def _pick_token(m_ptr, l_ptr, cnt_ptr, cand_z_ptr, cand_v_ptr, key, temp, tokens_ptr, logprobs_ptr,
                    b, k, S: tl.constexpr, S_PAD: tl.constexpr, C: tl.constexpr, KEY_BITS: tl.constexpr,
                    LIBDEVICE: tl.constexpr, SHORT: tl.constexpr, READS_EARLY: tl.constexpr = False):
        """Phase 2 (row b's last program): the row's top-k among its S * C candidates (already in vocab id order),
        then `_draw_store` with the row's log-softmax normaliser."""
        if READS_EARLY:  # every read (counts, slots, the slices' max and sums) before the first reduction
            j, valid, z, v = _row_candidates(cnt_ptr, cand_z_ptr, cand_v_ptr, b, S, S_PAD, C, True)
            top_m, log_sum, _ = row_log_normaliser(m_ptr, l_ptr, b, S, S_PAD)
        else:
            top_m, log_sum, _ = row_log_normaliser(m_ptr, l_ptr, b, S, S_PAD)
            j, valid, z, v = _row_candidates(cnt_ptr, cand_z_ptr, cand_v_ptr, b, S, S_PAD, C)
        keep = _row_keep_first(z, valid, k, cnt_ptr, b, S, S_PAD, C, KEY_BITS, SHORT)
        return _draw_store(z, v, keep, j, S_PAD * C, key, temp, tokens_ptr, logprobs_ptr, b, top_m, log_sum, LIBDEVICE)

    @triton.jit
    def _ahead_of(row_z, row_v, zi, vi, jj, n):
        """([N, J] mask: compacted slot jj (< n) comes before slot i under the total order, logit descending then
        vocab id ascending; the logits of slots jj)."""
        zj = tl.load(row_z + jj, mask=jj < n, other=float("-inf"))
        vj = tl.load(row_v + jj, mask=jj < n, other=0)
        ahead = (zj[None, :] > zi[:, None]) | ((zj[None, :] == zi[:, None]) & (vj[None, :] < vi[:, None]))
        return ahead & (jj < n)[None, :], zj

    @triton.jit
    def _compact_first(cnt_ptr, cand_z_ptr, cand_v_ptr, b, k, S: tl.constexpr, S_PAD: tl.constexpr, C: tl.constexpr,
                       KEY_BITS: tl.constexpr, SHORT: tl.constexpr):
        """Row b's first k candidates under the total order, moved into the row's first k slots (still in vocab id
        order; k <= C); returns k or fewer when the row has fewer."""
        _, valid, z, v = _row_candidates(cnt_ptr, cand_z_ptr, cand_v_ptr, b, S, S_PAD, C)
        keep = _row_keep_first(z, valid, k, cnt_ptr, b, S, S_PAD, C, KEY_BITS, SHORT)
        tl.debug_barrier()  # every lane has its candidates before the kept ones overwrite the first slots
        _compact(keep, z, v, cand_z_ptr + b * S * C, cand_v_ptr + b * S * C)
        tl.debug_barrier()
        return tl.sum(keep.to(tl.int32), 0)

    @triton.jit
    def _ranked_first(cnt_ptr, cand_z_ptr, cand_v_ptr, b, k, S: tl.constexpr, S_PAD: tl.constexpr, C: tl.constexpr,
                      N_PAD: tl.constexpr, J: tl.constexpr, KEY_BITS: tl.constexpr, m64, MASS: tl.constexpr,
                      SHORT: tl.constexpr):
        """Row b's first k candidates, compacted (`_compact_first`), as N_PAD lanes: (lane, how many, their logits
        (-inf past them), vocab ids, each one's rank among them (the kept tokens ahead, J at a time) and, with
        MASS, the fp64 sum of exp(z - m64) over those ahead)."""
        n = _compact_first(cnt_ptr, cand_z_ptr, cand_v_ptr, b, k, S, S_PAD, C, KEY_BITS, SHORT)
        row_z, row_v = cand_z_ptr + b * S * C, cand_v_ptr + b * S * C
        i = tl.arange(0, N_PAD)
        zi = tl.load(row_z + i, mask=i < n, other=float("-inf"))
        vi = tl.load(row_v + i, mask=i < n, other=0)
        ahead_mass = tl.zeros([N_PAD], tl.float64)
        rank = tl.zeros([N_PAD], tl.int32)
        for j0 in tl.static_range(0, N_PAD, J):
            ahead, zj = _ahead_of(row_z, row_v, zi, vi, j0 + tl.arange(0, J), n)
            if MASS:
                ej = tl.exp(zj.to(tl.float64) - m64)
                ahead_mass += tl.sum(tl.where(ahead, ej[None, :], 0.0), 1)
            rank += tl.sum(ahead.to(tl.int32), 1)
        return i, n, zi, vi, rank, ahead_mass

    @triton.jit
    def _pick_token_top_p(m_ptr, l_ptr, l64_ptr, cnt_ptr, cand_z_ptr, cand_v_ptr, key, temp, top_p,
                          tokens_ptr, logprobs_ptr, b, k, S: tl.constexpr, S_PAD: tl.constexpr, C: tl.constexpr,
                          N_PAD: tl.constexpr, J: tl.constexpr, KEY_BITS: tl.constexpr, LIBDEVICE: tl.constexpr,
                          SHORT: tl.constexpr):
        """Phase 2 with top-p (row b's last program): among the row's top-k, the tokens whose softmax mass ahead of
        them (under the total order) is at most top_p, plus the first; then `_draw_store`.
        The mass is exp(z - M) summed in fp64 over the tokens ahead, against top_p times the fp64 sum over the
        whole row (the slices' l64): the sampler's torch path computes the same sums in fp64, so the two keep the
        same nucleus up to fp64 rounding."""
        top_m, log_sum, m_S = row_log_normaliser(m_ptr, l_ptr, b, S, S_PAD)
        sp = tl.arange(0, S_PAD)
        l64_S = tl.load(l64_ptr + b * S + sp, mask=sp < S, other=0.0, cache_modifier=".cg")
        m64 = top_m.to(tl.float64)
        total = tl.sum(l64_S * tl.exp(m_S.to(tl.float64) - m64), 0)
        i, n, zi, vi, rank, ahead_mass = _ranked_first(cnt_ptr, cand_z_ptr, cand_v_ptr, b, k, S, S_PAD, C, N_PAD, J,
                                                       KEY_BITS, m64, True, SHORT)
        kept = (i < n) & ((ahead_mass <= top_p.to(tl.float64) * total) | (rank == 0))
        # (the compacted slots are in vocab id order, as `_draw_store` needs)
        return _draw_store(zi, vi, kept, i, N_PAD, key, temp, tokens_ptr, logprobs_ptr, b, top_m, log_sum, LIBDEVICE)

    @triton.jit
    def _topk_sample(logits_ptr, keys_ptr, temps_ptr, top_ks_ptr, m_ptr, l_ptr, cnt_ptr, cand_z_ptr, cand_v_ptr,
                     done_ptr, tokens_ptr, logprobs_ptr, s_lb, max_top_k, V: tl.constexpr, S: tl.constexpr,
                     S_PAD: tl.constexpr, BLOCK_V: tl.constexpr, C: tl.constexpr, KEY_BITS: tl.constexpr,
                     LIBDEVICE: tl.constexpr, top_ps_ptr=None, l64_ptr=None, TOP_P: tl.constexpr = False,
                     N_PAD: tl.constexpr = 16, J: tl.constexpr = 16, out_ptr=None, s_out=0, rec_k=0,
                     rec_steps=1, ids_ptr=None, pos_ptr=None, slots_ptr=None, lens_ptr=None, tables_ptr=None, s_tb=0,
                     BLOCK_SIZE: tl.constexpr = 1, RECORD: tl.constexpr = False, HAS_LOGPROBS: tl.constexpr = False,
                     ADVANCE: tl.constexpr = False, EARLY: tl.constexpr = False, PDL: tl.constexpr = False,
                     SHORT: tl.constexpr = False, GROUPS: tl.constexpr = 0, READS_EARLY: tl.constexpr = False):
        """Program (b, s), s < S: phase 1 over vocab slice s of row b; the row's last program to finish
        (`last_arrival` on done[b], which it resets to 0) runs phase 2. k = clamp(top_k, 1, max_top_k).
        TOP_P: phase 2 also applies each row's top_p (`_pick_token_top_p`; N_PAD >= max_top_k, J per step).
        RECORD and PDL: as in `_gumbel_sample`. SHORT: the short bisections (`_kth_largest`, `_keep_first`).
        GROUPS: phase 1's candidates from the group bound (`_slice_candidates`; C holds twice the top-k).
        READS_EARLY (`TOPK_READS_EARLY`): phase 2 without top-p issues all of its reads before its first reduction
        (`_pick_token`; every candidate slot with the counts: `_row_candidates` ALL_SLOTS)."""
        pdl_launch_next(PDL, EARLY)
        pdl_wait(PDL, EARLY)
        b = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        k = tl.maximum(tl.minimum(tl.load(top_ks_ptr + b), max_top_k), 1).to(tl.int32)
        # what only the row's last program uses, loaded by all, so that its latency overlaps phase 1
        key = tl.load(keys_ptr + b).to(tl.uint32)
        temp = tl.load(temps_ptr + b)
        top_p = 1.0
        if TOP_P:
            top_p = tl.load(top_ps_ptr + b)
        if RECORD:
            p_next, n_next, slot_next = record_next(b, b >= 0, pos_ptr, lens_ptr, tables_ptr, s_tb, BLOCK_SIZE, ADVANCE)
        _slice_candidates(logits_ptr, m_ptr, l_ptr, cnt_ptr, cand_z_ptr, cand_v_ptr, b, s, k, s_lb, V, S, BLOCK_V, C,
                          KEY_BITS, l64_ptr, TOP_P, SHORT, GROUPS)
        if last_arrival(done_ptr + b, S):
            if TOP_P:
                token, logprob = _pick_token_top_p(m_ptr, l_ptr, l64_ptr, cnt_ptr, cand_z_ptr, cand_v_ptr, key, temp,
                                                   top_p, tokens_ptr, logprobs_ptr, b, k, S, S_PAD, C, N_PAD, J,
                                                   KEY_BITS, LIBDEVICE, SHORT)
            else:
                token, logprob = _pick_token(m_ptr, l_ptr, cnt_ptr, cand_z_ptr, cand_v_ptr, key, temp, tokens_ptr,
                                             logprobs_ptr, b, k, S, S_PAD, C, KEY_BITS, LIBDEVICE, SHORT, READS_EARLY)
            if RECORD:
                record_rows(token, logprob, b, b >= 0, out_ptr, s_out, rec_k, rec_steps, ids_ptr, pos_ptr, slots_ptr,
                            lens_ptr, p_next, n_next, slot_next, HAS_LOGPROBS, ADVANCE)

    @triton.jit
    def _store_ranked(cnt_ptr, cand_z_ptr, cand_v_ptr, vals_ptr, ids_ptr, b, n, S: tl.constexpr,
                      S_PAD: tl.constexpr, C: tl.constexpr, N_PAD: tl.constexpr, J: tl.constexpr,
                      KEY_BITS: tl.constexpr):
        """Phase 2 of `_ranked_candidates` (row b's last program): the row's first n tokens under the total order,
        stored in that order into vals / ids [B, n]. The kept candidates are compacted into the row's first C
        slots (n <= C), then each one's rank is the number of kept tokens ahead of it (J of them at a time)."""
        i, _, zi, vi, rank, _ = _ranked_first(cnt_ptr, cand_z_ptr, cand_v_ptr, b, n, S, S_PAD, C, N_PAD, J, KEY_BITS,
                                              0.0, False, False)
        tl.store(vals_ptr + b * n + rank, zi.to(vals_ptr.dtype.element_ty), mask=i < n)
        tl.store(ids_ptr + b * n + rank, vi.to(tl.int64), mask=i < n)

    @triton.jit
    def _ranked_candidates(logits_ptr, m_ptr, l_ptr, cnt_ptr, cand_z_ptr, cand_v_ptr, done_ptr, vals_ptr, ids_ptr,
                           s_lb, n, V: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr, BLOCK_V: tl.constexpr,
                           C: tl.constexpr, N_PAD: tl.constexpr, J: tl.constexpr, KEY_BITS: tl.constexpr):
        """Program (b, s): `_topk_sample`'s phase 1 with k = n; the row's last program ranks its first n tokens
        (`_store_ranked`): the sampler's `ranked_topk` in one launch."""
        b = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        _slice_candidates(logits_ptr, m_ptr, l_ptr, cnt_ptr, cand_z_ptr, cand_v_ptr, b, s, n, s_lb, V, S, BLOCK_V, C,
                          KEY_BITS)
        if last_arrival(done_ptr + b, S):
            _store_ranked(cnt_ptr, cand_z_ptr, cand_v_ptr, vals_ptr, ids_ptr, b, n, S, S_PAD, C, N_PAD, J, KEY_BITS)


# the top-k draw's bisections stop once their range is one key, and phase 2's starts at the slices' bound
# (`_keep_first`). H200, B=1 top-k 50: 12.6 against 13.6 us alone, engine.step 3.038/3.032 against 3.043/3.047 ms
# per 8 steps (BENCHMARKS.md, session 14); MOELOOP_TOPK_SHORT=off runs the fixed 16/32-step bisections
TOPK_SHORT = os.environ.get("MOELOOP_TOPK_SHORT", "on").lower() != "off"
# phase 1 keeps every token at or above the k-th largest of 128 group maxima (`_group_bound`) rather than bisecting
# for its exact top-k, in slots for twice the top-k. H200, top-k 50 alone: B=1 10.9 against 12.3 us, B=128 34.0
# against 48.1, B=256 55.1 against 85.2 (B=8 16.0 against 15.6); BENCHMARKS.md, session 14.
# MOELOOP_TOPK_GROUPS=off: the exact top-k per slice by bisection
TOPK_GROUPS = os.environ.get("MOELOOP_TOPK_GROUPS", "on").lower() != "off"
# the top-k draw's phase 2 (no top-p) reads every candidate slot together with the slices' counts, masking after
# (`_row_candidates` ALL_SLOTS), and the slices' maxima and sums with them, before its first reduction. In sm_90 SASS
# the slot reads otherwise wait for the counts, and come after the normaliser's barriers (20 loads in two round trips
# -> 8 in one). H200, session 25: `sampler.py` top-k 50 at B=1 10.5 against 10.8 us (B=8..256 within 0.2 us);
# rollout.py B=1 engine.step 2.880/2.882/2.878 against 2.890/2.884/2.879 ms per 8 steps (alternating: within the
# noise, not worse). MOELOOP_TOPK_READS_EARLY=off: the reads masked by the counts, after the normaliser
TOPK_READS_EARLY = os.environ.get("MOELOOP_TOPK_READS_EARLY", "on").lower() != "off"
TOPK_SPLITS = 16  # target programs per row of `topk_sample`: at B=1 one per row would leave most SMs idle
# warps per program of the two-phase top-k kernels; 0: 8 for one row (H200, top-k 50: 14.1 us against 15.2 with 4,
# session 12's `sampler.py --topk-sweep`; 8 was slower at B=32 and 256) or past 2048 values per phase, else 4
TOPK_WARPS = 0


class _SlicePlan:
    """The launch shape and scratch of the two-phase top-k kernels for logits [B, V] and up to `max_top_k`
    candidates per slice: S slices of BLOCK_V, C slots each (k_pad for the top-k, twice that with `groups`), the
    per-slice stats and counts, the row counters (`row_counters`). `superset`: phase 1 may keep the group bound's
    superset (`TOPK_GROUPS`, top-k up to 64, at most 2048 slots in phase 2)."""

    def __init__(self, logits_BV: torch.Tensor, max_top_k: int, superset: bool = False):
        B, V = logits_BV.shape
        dev = logits_BV.device
        self.block_v = min(max(triton.next_power_of_2(triton.cdiv(V, TOPK_SPLITS)), 128), 4096)
        self.S = triton.cdiv(V, self.block_v)
        self.s_pad = max(2, triton.next_power_of_2(self.S))
        self.k_pad = max(16, triton.next_power_of_2(max_top_k))
        # the group bound where phase 2 has at most 2048 candidate slots, as measured (V = 32000: 16 slices x 128)
        fits = self.s_pad * 2 * self.k_pad <= 2048
        self.groups = min(128, self.block_v) if superset and TOPK_GROUPS and max_top_k <= 64 and fits else 0
        self.C = self.k_pad * (2 if self.groups else 1)
        self.stats_2BS = torch.empty(2, B, self.S, dtype=torch.float32, device=dev)  # slice max, sum of exp
        self.cnt_BS = torch.empty(B, self.S, dtype=torch.int32, device=dev)
        self.cand_z_BSC = torch.empty(B, self.S, self.C, dtype=torch.float32, device=dev)
        self.cand_v_BSC = torch.empty(B, self.S, self.C, dtype=torch.int32, device=dev)
        self.done_B = row_counters(dev, B)
        self.num_warps = TOPK_WARPS or (4 if B > 1 and max(self.block_v, self.s_pad * self.C) <= 2048 else 8)

    def scratch(self) -> tuple:
        return self.stats_2BS[0], self.stats_2BS[1], self.cnt_BS, self.cand_z_BSC, self.cand_v_BSC, self.done_B

    def consts(self, logits_BV: torch.Tensor) -> dict:
        return dict(V=logits_BV.shape[1], S=self.S, S_PAD=self.s_pad, BLOCK_V=self.block_v, C=self.C,
                    KEY_BITS=16 if logits_BV.dtype == torch.bfloat16 else 32)


def topk_sample(logits_BV: torch.Tensor, keys_B: torch.Tensor, temperatures_B: torch.Tensor, top_ks_B: torch.Tensor,
                max_top_k: int, top_ps_B: torch.Tensor | None = None,
                record: StepRecord | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [B] int64, their raw temperature-1 logprobs [B] fp32) of the top-k Gumbel-max draw, in one launch;
    capture-safe. Row b keeps its first clamp(top_k_b, 1, max_top_k) tokens under (logit
    descending, vocab id ascending); with `top_ps_B`, of those only the ones whose softmax mass ahead is at most
    top_p_b (and the first: the sampler's nucleus, in fp64). A temperature-0 row takes the first. Tokens equal the
    torch path's; logprobs equal torch.log_softmax's up to fp32 rounding (another summation order). `record`: as
    in `gumbel_sample`."""
    if logits_BV.stride(-1) != 1:
        logits_BV = logits_BV.contiguous()
    B = logits_BV.shape[0]
    tokens_B = torch.empty(B, dtype=torch.int64, device=logits_BV.device)
    logprobs_B = torch.empty(B, dtype=torch.float32, device=logits_BV.device)
    if not B:
        return tokens_B, logprobs_B
    plan = _SlicePlan(logits_BV, max_top_k, superset=True)
    top_p = {}
    if top_ps_B is not None:
        top_p = dict(top_ps_ptr=top_ps_B.float().contiguous(), TOP_P=True, N_PAD=plan.k_pad, J=16,
                     l64_ptr=torch.empty(B, plan.S, dtype=torch.float64, device=logits_BV.device))
    _topk_sample[(B, plan.S)](logits_BV, keys_B.contiguous(), temperatures_B.float().contiguous(),
                              top_ks_B.contiguous(), *plan.scratch(), tokens_B, logprobs_B, logits_BV.stride(0),
                              max_top_k, **plan.consts(logits_BV), LIBDEVICE=not triton_interpreting(),
                              num_warps=plan.num_warps, SHORT=TOPK_SHORT, GROUPS=plan.groups,
                              READS_EARLY=TOPK_READS_EARLY, **top_p,
                              **launch_extras(logits_BV, record))
    return tokens_B, logprobs_B


def ranked_candidates(logits_BV: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values in the logits' dtype, vocab ids int64) [B, n], n <= V: each row's first n tokens under (logit
    descending, vocab id ascending), in that order, in one launch; capture-safe (the
    sampler's `ranked_topk` on CUDA)."""
    if logits_BV.stride(-1) != 1:
        logits_BV = logits_BV.contiguous()
    B = logits_BV.shape[0]
    vals_BN = logits_BV.new_empty(B, n)
    ids_BN = torch.empty(B, n, dtype=torch.int64, device=logits_BV.device)
    if not B:
        return vals_BN, ids_BN
    plan = _SlicePlan(logits_BV, n)
    n_pad = max(16, triton.next_power_of_2(n))
    _ranked_candidates[(B, plan.S)](logits_BV, *plan.scratch(), vals_BN, ids_BN, logits_BV.stride(0), n,
                                    **plan.consts(logits_BV), N_PAD=n_pad, J=min(n_pad, 64),
                                    num_warps=plan.num_warps)
    return vals_BN, ids_BN
