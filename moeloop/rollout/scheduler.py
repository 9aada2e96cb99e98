"""`Scheduler`: the waiting and running queues; picks each step's token chunks under the budgets.

Each step, running sequences go first (one decode token each, or the next chunk of a long prompt);
when a running sequence needs a block and none is free, the newest running sequence is preempted
(its blocks are freed; it re-queues at the front of `waiting` and is recomputed later — the prefix
cache usually still holds most of its blocks). Then, unless paused or something was preempted,
waiting sequences are admitted in FIFO order while `max_num_seqs`, `max_num_batched_tokens` and the
free blocks allow. Prefill and decode tokens go in one flat batch.

Forks (n samples, one prefill): when a group leader's chunk completes its prompt this step (a chunk of at least
2 tokens, so the batch never takes the decode-only CUDA-graph path), its waiting followers are forked instead of
prefilling the same prompt again: they take the leader's full prompt blocks by reference and a private block for the
partial last one (the runner copies those K/V slots after the forward), and sample their first token from the
leader's last-token logits with their own seeds. A follower that cannot fork waits for the leader and reuses its
cached prompt blocks as before.

Multi-step decode (`schedule(max_steps=K)`): a decode-only batch with nothing waiting runs up to K decode steps on
the device with no host round trip (`ScheduledBatch.num_steps`): as many as every sequence may still sample under
its max_tokens (with CUDA graphs, the largest of the runner's step counts that fits, a graph per count; the engine
keeps prompt + max_tokens within max_model_len), with the KV blocks for those positions taken ahead. The host checks
stops afterwards: tokens sampled past a sequence's stop token are dropped, as with async scheduling. Otherwise the
batch runs one step. Rows whose logits are processed (a repetition penalty, min-p) run multi-step as the others do:
the sampler applies them on the device, the seen tokens growing step by step (`multistep.step_sampler`).

With async scheduling a sequence may carry pending tokens (sampled by a step still on the device). It is
scheduled as usual (its next input comes from the device), except when its pending token is its last one
(max_tokens reached): then it waits, unscheduled, until the engine appends that token and finishes it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from moeloop.rollout.blocks import BlockManager
from moeloop.rollout.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # chunk length per sequence
    forks: list[tuple[Sequence, int]] = field(default_factory=list)  # (follower, its leader's index in seqs)
    prompt_ends: dict[int, int] = field(default_factory=dict)  # seq_id -> index, chunks that complete a prompt
    num_steps: int = 1  # decode steps run on the device before the host sees the tokens (multi-step decode)

    def add(self, seq: Sequence, chunk: int) -> None:
        if chunk >= 2 and len(seq.token_ids) == seq.num_prompt_tokens == seq.num_computed_tokens + chunk:
            self.prompt_ends[seq.seq_id] = len(self.seqs)
        self.seqs.append(seq)
        self.num_new_tokens.append(chunk)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)

    def sample_rows(self) -> list[int]:
        """Indices of the sequences that sample this step (`samples(i)` for every i, in one pass)."""
        return [i for i, (seq, n) in enumerate(zip(self.seqs, self.num_new_tokens)) if _reaches_end(seq, n)]

    def samples(self, i: int) -> bool:
        """Does sequence i reach its last token this step (so a new token is sampled)?"""
        return _reaches_end(self.seqs[i], self.num_new_tokens[i])


def _reaches_end(seq: Sequence, num_new_tokens: int) -> bool:
    return seq.num_computed_tokens + num_new_tokens == len(seq)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.paused = False
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.running) or (bool(self.waiting) and not self.paused)

    def schedule(self, max_steps: int = 1, step_counts: tuple[int, ...] | None = None) -> ScheduledBatch:
        """The next batch; a decode-only one may run up to `max_steps` steps (only one of `step_counts`, if given:
        a CUDA graph is captured per step count)."""
        batch = ScheduledBatch()
        budget, all_running_fit = self._schedule_running(batch, self.max_num_batched_tokens)
        if not self.paused and all_running_fit and not self._preempted_this_step:
            self._admit_waiting(batch, budget)
        if max_steps > 1 and batch.seqs and not self.waiting and not batch.forks and all_running_fit:
            self._look_ahead(batch, max_steps, step_counts)
        return batch

    def _look_ahead(self, batch: ScheduledBatch, steps: int, counts: tuple[int, ...] | None) -> None:
        """Make a decode-only batch run several decode steps: as many as every sequence may still sample (max_tokens),
        at most `steps` (the largest of `counts` within that, if given), if the blocks for their K/V are free (taken
        now); else leave it at one step."""
        if any(n != 1 or not _reaches_end(seq, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)):
            return  # (a 1-token chunk of a prompt that continues does not sample: its next inputs are prompt tokens)
        room = min(seq.params.max_tokens - seq.num_response_tokens for seq in batch.seqs)
        steps = min(steps, room)
        if counts is not None:
            steps = max((c for c in counts if c <= steps), default=1)
        if steps < 2:
            return
        blocks = self.blocks
        extra = [blocks.new_blocks_needed(seq, steps) for seq in batch.seqs]  # beyond the one step grown already
        if sum(extra) > blocks.num_free_blocks:
            return
        for seq, need in zip(batch.seqs, extra):
            if need:
                blocks.grow(seq, steps)
        batch.num_steps = steps

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> tuple[int, bool]:
        self._preempted_this_step = False
        pending, kept = deque(self.running), []
        blocks = self.blocks
        blocks_needed, add, keep = blocks.new_blocks_needed, batch.add, kept.append  # per sequence per step
        while pending and budget > 0:
            seq = pending.popleft()
            if seq.awaits_last_token:
                keep(seq)  # nothing left to compute
                continue
            chunk = min(len(seq) - seq.num_computed_tokens, budget)
            need = blocks_needed(seq, chunk)  # 0 for a decode token inside its last block
            while need and need > blocks.num_free_blocks:
                victim = pending.pop() if pending else seq
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                if need:
                    blocks.grow(seq, chunk)
                add(seq, chunk)
                keep(seq)
                budget -= chunk
        self.running = kept + list(pending)  # unscheduled ones (budget spent) stay running
        return budget, not pending

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        skipped: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._fork(seq, batch):
                continue
            if budget <= 0:
                break
            shareable = (len(seq) - 1) // self.blocks.block_size  # full prompt blocks a follower could share
            if (seq.blocked_on_leader and shareable) or seq.num_pending:  # pending: its last token reaches the host first
                skipped.append(self.waiting.popleft())
                continue
            hits = self.blocks.match_prefix(seq)
            chunk = min(len(seq) - len(hits) * self.blocks.block_size, budget)
            if self.blocks.new_blocks_needed(seq, chunk, hits) > self.blocks.num_free_blocks:
                break
            self.waiting.popleft()
            self.blocks.take_prefix(seq, hits)
            self.blocks.grow(seq, chunk)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, chunk)
            budget -= chunk
        self.waiting.extendleft(reversed(skipped))

    def _fork(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Admit a fresh follower (the head of `waiting`) as a fork of its leader, if the leader's prompt completes in
        this batch and a block for the partial last prompt block is free."""
        lead = seq.leader
        if lead is None or seq.num_computed_tokens or seq.num_pending or len(seq.token_ids) != seq.num_prompt_tokens:
            return False
        index = batch.prompt_ends.get(lead.seq_id)
        if index is None or self.blocks.fork_blocks_needed(seq) > self.blocks.num_free_blocks:
            return False
        self.waiting.popleft()
        self.blocks.fork(seq, lead)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.forks.append((seq, index))
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and put it back at the front of the queue (recompute later)."""
        if seq in self.running:
            self.running.remove(seq)
        self.blocks.free_seq(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._preempted_this_step = True
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        seq.num_pending = 0
        self.blocks.free_seq(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:  # preempted after it sampled a token that finished it
            self.waiting.remove(seq)

    def requeue_running(self) -> list[Sequence]:
        """Abort every running sequence and re-queue it from its prompt (drain with abort)."""
        seqs, self.running = self.running, []
        for seq in reversed(seqs):
            self.blocks.free_seq(seq)
            seq.reset_response()
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        return seqs
