"""`Sampler`: next tokens from logits (greedy / temperature / top-k / top-p / min-p, repetition penalty) and their fp32
logprobs (always the raw logits').

Randomness is counter-based, not a shared generator: the noise for a row is a hash of
(sequence seed, response-token index, vocab id), so a sample depends only on its own seed and
position — never on batch composition, preemption or step order. Sampling uses the Gumbel-max
trick: argmax(filtered_logits / T + Gumbel(u)) is a draw from softmax(filtered_logits / T).
One rule in every path (torch or kernels, any batch): top-k keeps the first k tokens under (logit descending, vocab
id ascending) (`ranked_topk`), and among equal Gumbel scores the smallest vocab id wins.
A batch with a repetition penalty or min-p (`logit_processors`) draws in torch ops over the full vocab
(`Sampler._processed`); every other batch takes the paths below, those tensors absent.
Shapes: B rows (sequences sampled this step), V vocab.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from moeloop.model.kernel_switch import kernels_apply
from moeloop.rollout.gumbel_kernel import StepRecord, gumbel_sample, topk_gumbel_argmax
from moeloop.rollout.logit_processors import min_p_drop, penalise_repetitions
from moeloop.rollout.topk_kernel import ranked_candidates, topk_sample

_M32 = 0xFFFFFFFF


def row_key(seed: int, counter: int) -> int:
    """32-bit key of one (sequence seed, token index) pair (`row_keys` of one row)."""
    return int(row_keys([seed], [counter])[0])


def row_keys(seeds: list[int], counters: list[int]) -> np.ndarray:
    """32-bit keys (int64) of (sequence seed, token index) pairs: the splitmix64 finaliser of seed * golden +
    counter + 1, in numpy uint64 (wrapping mod 2**64); it runs on the host for every sampled row of every step."""
    z = np.array(seeds, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.array(counters, dtype=np.uint64)
    z += np.uint64(1)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((z ^ (z >> np.uint64(31))) & np.uint64(_M32)).astype(np.int64)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 integer hash on int64 tensors holding uint32 values (low 32 bits of each product)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_noise(keys_B: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """U(0,1) [B, V] in fp32 (24-bit resolution) from per-row keys; identical on every device."""
    return noise_at(keys_B, torch.arange(vocab_size, device=keys_B.device, dtype=torch.int64)[None, :])


def noise_at(keys_B: torch.Tensor, vocab_BN: torch.Tensor) -> torch.Tensor:
    """`uniform_noise` at the given vocab ids only ([B, N] or [1, N]): the same value a full row would hold."""
    if keys_B.device.type == "cpu":
        return _noise_at_numpy(keys_B, vocab_BN)
    h_BN = _mix32(_mix32(keys_B[:, None] ^ vocab_BN) ^ keys_B[:, None])
    return ((h_BN >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def _noise_at_numpy(keys_B: torch.Tensor, vocab_BN: torch.Tensor) -> torch.Tensor:
    """`noise_at` on the host in native uint32 (products wrap mod 2**32: the low 32 bits `_mix32` keeps), a third of
    the tensor ops' time at sampling sizes; the same bits (integer hash, then exact or correctly rounded fp32)."""
    keys = keys_B.numpy().astype(np.uint32)[:, None]
    h = _mix32_numpy(_mix32_numpy(keys ^ vocab_BN.numpy().astype(np.uint32)) ^ keys)
    return torch.from_numpy(((h >> 8).astype(np.float32) + np.float32(0.5)) * np.float32(1.0 / (1 << 24)))


def _mix32_numpy(x: np.ndarray) -> np.ndarray:
    """`_mix32` on a uint32 array, in place."""
    x ^= x >> 16
    x *= np.uint32(0x7FEB352D)
    x ^= x >> 15
    x *= np.uint32(0x846CA68B)
    x ^= x >> 16
    return x


@dataclass
class SamplingTensors:
    temperatures_B: torch.Tensor  # fp32; 0 = greedy
    top_ks_B: torch.Tensor  # int64; V = off
    top_ps_B: torch.Tensor  # fp32; 1 = off
    keys_B: torch.Tensor  # int64 row keys from `row_key`
    any_filter: bool
    all_greedy: bool
    max_top_k: int | None = None  # host max of top_ks_B; small -> sample among `ranked_topk` candidates (no sort)
    any_greedy: bool = True  # some row has temperature 0 (False: no greedy argmax needed)
    any_top_p: bool = True  # some row has top_p < 1 (False: no nucleus mask needed)
    # `logit_processors.processing_fields`; a multi-step launch adds each step's tokens to seen_BV
    penalties_B: torch.Tensor | None = None  # fp32 repetition penalties (1 = off); None: no row has one
    seen_BV: torch.Tensor | None = None  # bool: the token ids in each penalised row's sequence so far
    min_ps_B: torch.Tensor | None = None  # fp32 (0 = off); None: no sampled row has min-p

    @property
    def processes_logits(self) -> bool:
        return self.penalties_B is not None or self.min_ps_B is not None

    @classmethod
    def packed(cls, floats_2B: torch.Tensor, ints_XB: torch.Tensor, flags: dict, **processing) -> "SamplingTensors":
        """From the runner's packed layout (`ModelRunner._sampling_host`): floats [2, B] (temperatures, top-ps),
        ints [1 + K, B] (top-ks, then each step's row keys; keys_B is step 0's); `processing`: penalties_B, seen_BV,
        min_ps_B, where given."""
        return cls(floats_2B[0], ints_XB[0], floats_2B[1], ints_XB[1], **flags, **processing)


TOPK_CANDIDATES_MAX = 1024  # a top-k up to this samples among `ranked_topk` candidates, not a full-vocab sort
FUSED_TOPK_MAX = 256  # up to this: `ranked_topk` and the top-k draw (`topk_sample`) are one launch each
# top-k + top-p in that one launch too (session 11); MOELOOP_FUSED_TOP_P=off: `ranked_topk`, the nucleus mask in torch
# ops, `topk_gumbel_argmax` and log_softmax instead (the same tokens)
FUSED_TOP_P = os.environ.get("MOELOOP_FUSED_TOP_P", "on").lower() != "off"


def ranked_topk(logits_BV: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, vocab ids) [B, min(n, V)] of each row's first n tokens under (logit descending, vocab id ascending),
    in that order: torch.topk over a unique int64 key, so ties at the n-th value keep the smallest ids on every
    device (torch.topk alone leaves that choice unspecified). No host sync. With the kernels and n <= FUSED_TOPK_MAX
    one launch (`ranked_candidates`), else torch ops."""
    n = min(n, logits_BV.shape[-1])
    if kernels_apply(logits_BV) and n <= FUSED_TOPK_MAX:
        return ranked_candidates(logits_BV, n)
    bits_BV = logits_BV.float().view(torch.int32)
    key_BV = torch.where(bits_BV >= 0, bits_BV, bits_BV ^ 0x7FFFFFFF)  # int32 in the fp32 order
    key_BV = key_BV.masked_fill(logits_BV == 0, 0).to(torch.int64)  # -0.0 ties +0.0, as they compare
    ids_V = torch.arange(logits_BV.shape[-1], device=logits_BV.device)
    ids_BN = (key_BV * (1 << 32) + (_M32 - ids_V)).topk(n, dim=-1).indices
    return logits_BV.gather(1, ids_BN), ids_BN


def nucleus_drop(vals_BN: torch.Tensor, logits_BV: torch.Tensor, top_ps_B: torch.Tensor) -> torch.Tensor:
    """Mask of the ranked candidates vals_BN (each row's first N tokens, in order) outside the top-p nucleus: those
    whose softmax mass ahead of them exceeds top_p, i.e. sum of exp(z - M) over the tokens ahead > top_p * sum of
    exp(z - M) over the row, in fp64 (the fused draw, `topk_sample`, sums the same in fp64, in another order, so
    the two agree up to fp64 rounding). The first candidate is never dropped."""
    max_B1 = logits_BV.amax(dim=-1, keepdim=True).double()
    e_BN = (vals_BN.double() - max_B1).exp()
    total_B1 = (logits_BV.double() - max_B1).exp().sum(dim=-1, keepdim=True)
    ahead_BN = torch.cat([torch.zeros_like(e_BN[:, :1]), e_BN.cumsum(dim=-1)[:, :-1]], dim=-1)
    drop_BN = ahead_BN > top_ps_B.double()[:, None] * total_B1
    drop_BN[:, 0] = False
    return drop_BN


def filter_logits(logits_BV: torch.Tensor, top_ks_B: torch.Tensor, top_ps_B: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus (`nucleus_drop`) to -inf (always keeps the argmax).
    The stable sort ranks equal logits by vocab id: `ranked_topk`'s order."""
    sorted_BV, order_BV = logits_BV.sort(dim=-1, descending=True, stable=True)
    rank_V = torch.arange(logits_BV.shape[-1], device=logits_BV.device)
    drop_BV = rank_V[None, :] >= top_ks_B[:, None]
    drop_BV |= nucleus_drop(sorted_BV, logits_BV, top_ps_B)
    drop_BV[:, 0] = False
    sorted_BV = sorted_BV.masked_fill(drop_BV, float("-inf"))
    return torch.empty_like(logits_BV).scatter_(-1, order_BV, sorted_BV)


def penalised_logits(logits_BV: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """fp32 logits with the rows' repetition penalties applied (`penalise_repetitions`); a greedy row's token is
    their argmax."""
    z_BV = logits_BV.float()
    return z_BV if st.penalties_B is None else penalise_repetitions(z_BV, st.seen_BV, st.penalties_B)


def processed_scores(z_BV: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The scores whose argmax with Gumbel noise added is a sampled row's draw, from the penalised logits z_BV, in
    transformers' order: top-k/top-p (`filter_logits`: top-p's mass under the temperature-1 softmax of z_BV, as
    without a penalty), division by the temperature (1 on greedy rows), min-p on that (-inf where filtered)."""
    scores_BV = filter_logits(z_BV, st.top_ks_B, st.top_ps_B) if st.any_filter else z_BV
    temps_B = torch.where(st.temperatures_B > 0, st.temperatures_B, torch.ones_like(st.temperatures_B))
    scores_BV = scores_BV / temps_B[:, None]
    if st.min_ps_B is not None:
        scores_BV = scores_BV.masked_fill(min_p_drop(scores_BV, st.min_ps_B), float("-inf"))
    return scores_BV


def _sample_top_k(logits_BV: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """`filter_logits` + Gumbel-max restricted to each row's `max_top_k` first logits (`ranked_topk`; noise by vocab
    id, so the draw equals the full-vocab one). Top-p mass is measured under the full softmax, as `filter_logits`
    does. With the kernels, the rank/top-p masks, noise, scores and argmax are one launch (`topk_gumbel_argmax`)."""
    vals_BN, ids_BN = ranked_topk(logits_BV, st.max_top_k)
    nucleus_BN = nucleus_drop(vals_BN, logits_BV, st.top_ps_B) if st.any_top_p else None  # outside the nucleus
    if kernels_apply(logits_BV):
        return topk_gumbel_argmax(vals_BN, ids_BN, st.keys_B, st.temperatures_B, st.top_ks_B, nucleus_BN)
    rank_N = torch.arange(vals_BN.shape[-1], device=logits_BV.device)
    drop_BN = rank_N[None, :] >= st.top_ks_B[:, None]
    if nucleus_BN is not None:
        drop_BN |= nucleus_BN
    drop_BN[:, 0] = False
    temps_B = torch.where(st.temperatures_B > 0, st.temperatures_B, torch.ones_like(st.temperatures_B))
    gumbel_BN = -torch.log(-torch.log(noise_at(st.keys_B, ids_BN)))
    score_BN = vals_BN.masked_fill(drop_BN, float("-inf")) / temps_B[:, None] + gumbel_BN
    # the smallest id among equal maxima (candidates are in rank order, not id order)
    return ids_BN.masked_fill(score_BN < score_BN.amax(dim=-1, keepdim=True), logits_BV.shape[-1]).amin(dim=-1)


class Sampler:
    def __call__(self, logits_BV: torch.Tensor, st: SamplingTensors, want_logprobs: bool,
                 record: StepRecord | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (token ids [B], logprobs [B] of those tokens under the raw temperature-1 softmax). `record`
        (multi-step decode): a one-launch draw also writes the step's record and next inputs, and marks it written.

        With the kernels, bf16 logits are read as they are (the kernels, topk, argmax and the fp32 log_softmax
        widen each value exactly); the torch path works on an fp32 copy. Same tokens either way; the same logprobs
        too, except from the one-launch draws (`topk_sample`, `gumbel_sample`: their own fp32 log-softmax, within
        ~1e-6)."""
        if st.processes_logits:
            return self._processed(logits_BV, st, want_logprobs)
        if not kernels_apply(logits_BV):
            logits_BV = logits_BV.float()
        if st.all_greedy:
            return self._with_logprobs(logits_BV, logits_BV.argmax(dim=-1), want_logprobs)
        fused = self._one_launch(logits_BV, st, record)  # temperature-0 rows included: they take the first token
        if fused is not None:
            tokens_B, logprobs_B = fused
            return tokens_B, logprobs_B if want_logprobs else None
        if st.any_filter and st.max_top_k is not None and st.max_top_k <= TOPK_CANDIDATES_MAX:
            sampled_B = _sample_top_k(logits_BV, st)
        else:  # Gumbel-max over the full vocab (the same scores per vocab id as the top-k path)
            z_BV = filter_logits(logits_BV, st.top_ks_B, st.top_ps_B) if st.any_filter else logits_BV
            temps_B = torch.where(st.temperatures_B > 0, st.temperatures_B, torch.ones_like(st.temperatures_B))
            u_BV = uniform_noise(st.keys_B, logits_BV.shape[-1])
            gumbel_BV = -torch.log(-torch.log(u_BV))
            sampled_B = (z_BV / temps_B[:, None] + gumbel_BV).argmax(dim=-1)
        tokens_B = torch.where(st.temperatures_B > 0, sampled_B, logits_BV.argmax(dim=-1)) if st.any_greedy else sampled_B
        return self._with_logprobs(logits_BV, tokens_B, want_logprobs)

    def _processed(self, logits_BV: torch.Tensor, st: SamplingTensors,
                   want_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The draw of a batch with a repetition penalty or min-p: the argmax of the penalised logits on greedy rows,
        Gumbel-max over the full vocab of `processed_scores` on the others (the noise of every path; with the
        kernels one `gumbel_sample` launch at temperature 1, where torch ops run a dozen passes over [B, V] to hash
        the noise); logprobs of the raw logits."""
        z_BV = penalised_logits(logits_BV, st)
        tokens_B = z_BV.argmax(dim=-1)
        if not st.all_greedy:
            scores_BV = processed_scores(z_BV, st)
            if kernels_apply(scores_BV):
                sampled_B, _ = gumbel_sample(scores_BV, st.keys_B, torch.ones_like(st.temperatures_B))
            else:
                gumbel_BV = -torch.log(-torch.log(uniform_noise(st.keys_B, z_BV.shape[-1])))
                sampled_B = (scores_BV + gumbel_BV).argmax(dim=-1)
            tokens_B = torch.where(st.temperatures_B > 0, sampled_B, tokens_B)
        return self._with_logprobs(logits_BV.float(), tokens_B, want_logprobs)

    @staticmethod
    def _one_launch(logits_BV: torch.Tensor, st: SamplingTensors,
                    record: StepRecord | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(tokens, logprobs) from one kernel launch where the kernels apply: no filter (`gumbel_sample`), or top-k
        with max_top_k <= FUSED_TOPK_MAX, with or without top-p (`FUSED_TOP_P`; `topk_sample`); else None."""
        if not kernels_apply(logits_BV):
            return None
        if not st.any_filter:
            return gumbel_sample(logits_BV, st.keys_B, st.temperatures_B, record)
        if st.max_top_k is not None and st.max_top_k <= FUSED_TOPK_MAX and (FUSED_TOP_P or not st.any_top_p):
            return topk_sample(logits_BV, st.keys_B, st.temperatures_B, st.top_ks_B, st.max_top_k,
                               st.top_ps_B if st.any_top_p else None, record)
        return None

    @staticmethod
    def _with_logprobs(logits_BV: torch.Tensor, tokens_B: torch.Tensor,
                       want_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        logprobs_B = None
        if want_logprobs:
            logprobs_B = torch.log_softmax(logits_BV, dim=-1, dtype=torch.float32).gather(1, tokens_B[:, None])[:, 0]
        return tokens_B, logprobs_B
