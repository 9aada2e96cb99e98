"""Block manager and scheduler with fake model steps: prefix sharing, ref counts, preemption, budgets."""
from hypothesis import given, settings, strategies as st

from moeloop.rollout.blocks import BlockManager
from moeloop.rollout.sampling_params import SamplingParams
from moeloop.rollout.scheduler import Scheduler
from moeloop.rollout.sequence import Sequence


def make_group(prompt, n, params=SamplingParams(max_tokens=4), request_id="r"):
    leader = Sequence(request_id, 0, prompt, params, seed=0)
    return [leader] + [Sequence(request_id, i, prompt, params, seed=i, leader=leader) for i in range(1, n)]


def fake_step(sched: Scheduler, next_token=lambda seq: 7):
    """What the engine does after a forward: advance, commit hashes, append a token, finish at max."""
    batch = sched.schedule()
    sampled = [batch.samples(i) for i in range(len(batch))]
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        seq.num_computed_tokens += n
        sched.blocks.commit(seq)
    for seq in [s for s, yes in zip(batch.seqs, sampled) if yes] + [f for f, _ in batch.forks]:
        seq.append(next_token(seq), 0.0, 0)
        if seq.num_response_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")
    return batch


def check_ref_counts(bm: BlockManager, seqs):
    expected = [0] * bm.num_blocks
    for s in seqs:
        for b in s.block_table:
            expected[b] += 1
    assert [b.ref_count for b in bm.blocks] == expected
    assert set(bm.free) == {i for i, c in enumerate(expected) if c == 0}


def test_group_of_8_shares_prompt_blocks_once():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=256)
    prompt = list(range(10, 28))  # 18 tokens: 4 full blocks + a partial one
    group = make_group(prompt, 8)
    for s in group:
        sched.add(s)
    first = fake_step(sched)
    # the leader prefills; the followers fork from it: its 4 full prompt blocks, a copy of its partial one
    assert first.seqs == [group[0]] and first.num_new_tokens == [18]
    assert first.forks == [(s, 0) for s in group[1:]]
    assert all(s.num_computed_tokens == 18 and s.num_response_tokens == 1 for s in group)
    shared = group[0].block_table[:4]
    assert all(s.block_table[:4] == shared for s in group)
    assert all(bm.blocks[b].ref_count == 8 for b in shared)
    distinct = {b for s in group for b in s.block_table}
    assert len(distinct) == 4 + 8  # prompt's 4 full blocks once + one private partial block per sample
    assert bm.num_prefix_hit_blocks == 4 * 7
    check_ref_counts(bm, group)
    while sched.has_work():
        fake_step(sched)
    assert bm.num_free_blocks == bm.num_blocks


def test_followers_that_cannot_fork_reuse_the_cached_prompt():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=256)  # no room to fork: one sequence at a time
    group = make_group(list(range(10, 28)), 3)
    for s in group:
        sched.add(s)
    first = fake_step(sched)
    assert first.seqs == [group[0]] and not first.forks
    while group[0] in sched.running:
        fake_step(sched)
    second = fake_step(sched)
    assert second.seqs == [group[1]] and second.num_new_tokens == [2]  # 4 cached blocks, its own 2-token tail
    while sched.has_work():
        fake_step(sched)
    assert bm.num_free_blocks == bm.num_blocks


def test_fork_needs_a_free_block_for_the_partial_prompt_block():
    bm = BlockManager(num_blocks=6, block_size=4)  # leader 5 blocks (18 tokens + room): 1 left for one fork
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=256)
    group = make_group(list(range(10, 28)), 3)
    for s in group:
        sched.add(s)
    first = fake_step(sched)
    assert [f for f, _ in first.forks] == [group[1]] and list(sched.waiting) == [group[2]]
    check_ref_counts(bm, sched.running)
    for _ in range(100):
        if not sched.has_work():
            break
        fake_step(sched)
        check_ref_counts(bm, sched.running)
    assert all(s.num_response_tokens == 4 for s in group) and bm.num_free_blocks == bm.num_blocks


def test_prefix_cache_across_requests_and_eviction():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = Sequence("a", 0, list(range(9)), SamplingParams(max_tokens=1), seed=0)
    sched.add(a)
    while sched.has_work():
        fake_step(sched)
    b = Sequence("b", 0, list(range(9)) + [99], SamplingParams(max_tokens=1), seed=0)
    assert len(bm.match_prefix(b)) == 2  # finished request's blocks are still cached
    c = Sequence("c", 0, [5] + list(range(1, 9)), SamplingParams(max_tokens=1), seed=0)
    assert bm.match_prefix(c) == []  # chained hash: a different first block breaks the chain
    sched.add(b)
    batch = fake_step(sched)
    assert batch.num_new_tokens == [2]
    # fill the cache with other data until a's blocks are evicted
    for r in range(4):
        s = Sequence(f"x{r}", 0, [100 + r] * 31, SamplingParams(max_tokens=1), seed=0)
        sched.add(s)
        while sched.has_work():
            fake_step(sched)
    assert bm.match_prefix(Sequence("d", 0, list(range(9)), SamplingParams(), seed=0)) == []


def test_preemption_frees_blocks_and_recomputes():
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [Sequence(f"r{i}", 0, [i] * 7, SamplingParams(max_tokens=8), seed=0) for i in range(3)]
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_work():
        fake_step(sched, next_token=lambda seq: seq.num_response_tokens)
        check_ref_counts(bm, sched.running)
        steps += 1
        assert steps < 200
    assert sched.num_preemptions > 0
    assert all(s.response_ids == list(range(8)) for s in seqs)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=10), num_blocks=st.integers(8, 40),
       budget=st.integers(1, 64), max_tokens=st.integers(1, 6), n=st.integers(1, 3))
def test_scheduler_invariants(lengths, num_blocks, budget, max_tokens, n):
    bs = 4
    bm = BlockManager(num_blocks=num_blocks, block_size=bs)
    sched = Scheduler(bm, max_num_seqs=5, max_num_batched_tokens=budget)
    seqs = []
    for i, L in enumerate(lengths):
        if bm.blocks_for(L + max_tokens) > num_blocks:
            continue
        group = make_group([i % 3] * L, n, SamplingParams(max_tokens=max_tokens), request_id=str(i))
        for s in group:
            sched.add(s)
        seqs += group
    for _ in range(2000):
        if not sched.has_work():
            break
        batch = fake_step(sched)
        assert batch.num_tokens <= budget and len(sched.running) <= 5
        check_ref_counts(bm, sched.running)
    assert not sched.has_work()
    assert all(s.num_response_tokens == max_tokens for s in seqs)
    assert bm.num_free_blocks == num_blocks
