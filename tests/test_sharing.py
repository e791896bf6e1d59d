"""Sharing pages: parallel sampling (n samples share the prompt, copy-on-write) and prefix caching.

The prefix cache alone (hash chain, hits, LRU eviction, no stale entry after a page is reused or a step
is rolled back), then the engine on the tiny transformers Llama of test_engine.py: greedy tokens against
transformers' float64 decode (a divergence only where its top-2 logits nearly tie), sampled tokens
against independent requests, and a property test over random mixes of shared-prefix requests, n > 1,
preemption and eviction in a tiny pool, checking the pool after every step.
"""

from collections import Counter
from functools import cache

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from vllmini import prefix_cache as pc
from vllmini.block_manager import BlockManager
from vllmini.engine import LLMEngine
from vllmini.errors import InvalidArgumentError, InvalidTypeError, OutOfBlocksError
from vllmini.outputs import sharing_summary
from vllmini.sampling import SamplingParams, sample_seed

transformers = pytest.importorskip("transformers")
from engine_faults import fails_once_per_step  # noqa: E402
from llama_cases import TIE, assert_greedy, greedy_reference  # noqa: E402 (needs transformers)

BS = 4


# -----------------------------------------------------------------------------
# the prefix cache in the block manager


def _cached_manager(num_blocks=8, block_size=BS):
    return BlockManager(num_blocks, block_size, enable_prefix_caching=True)


def _run_seq(bm, seq_id, tokens, shared=()):
    """Allocate a sequence, 'compute' all its tokens and name its full blocks; returns its hash chain."""
    hashes = []
    bm.allocate(seq_id, len(tokens), shared=shared)
    bm.cache_full_blocks(seq_id, tokens, hashes, len(shared) * bm.block_size, len(tokens))
    return hashes


def check_pool(bm: BlockManager) -> None:
    """Reference counts, free list, cache and tables agree (between steps: no copy pending)."""
    a, cache = bm.allocator, bm.prefix_cache
    owners = Counter(b for s in bm.seq_ids for b in bm.block_table(s).block_ids)
    evictable = set(cache.evictable) if cache is not None else set()
    free = set(a.free_block_ids)
    assert not bm.num_pinned_blocks and all(not bm.block_table(s).pending_copies for s in bm.seq_ids)
    for b in range(bm.num_blocks):
        assert a.ref_count(b) == owners[b] + (b in evictable), b
    assert free.isdisjoint(owners) and free.isdisjoint(evictable) and evictable.isdisjoint(owners)
    assert all(cache.is_cached(b) for b in evictable)
    assert bm.num_free_blocks == len(free) + len(evictable)
    assert bm.utilization()["used_blocks"] + bm.num_free_blocks == bm.num_blocks
    assert bm.sharing()["cached_blocks"] == len(evictable)


def test_hash_chain_names_the_whole_prefix():
    a = pc.block_hash(None, [1, 2, 3, 4])
    assert a == pc.block_hash(None, [1, 2, 3, 4]) and len(a) == pc.HASH_BYTES
    assert pc.block_hash(a, [5, 6, 7, 8]) != pc.block_hash(pc.block_hash(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert pc.block_hash(None, [1, 2, 3, 4]) != pc.block_hash(None, [1, 2, 3, 5])
    hashes = pc.extend_hashes([], list(range(10)), 2, 4)
    assert hashes == [pc.block_hash(None, [0, 1, 2, 3]), pc.block_hash(hashes[0], [4, 5, 6, 7])]
    assert pc.extend_hashes(hashes, list(range(10)), 2, 4) is hashes and len(hashes) == 2


def test_finished_prefix_stays_cached_and_is_found_again():
    bm = _cached_manager()
    tokens = list(range(10, 22))  # 3 full blocks
    _run_seq(bm, "a", tokens)
    blocks = bm.block_table("a").block_ids
    bm.free("a")
    check_pool(bm)
    assert bm.num_free_blocks == 8 and bm.num_cached_free_blocks == 3  # free for admission, still cached
    # the tail block was freed first: it is the least recently used
    assert list(bm.prefix_cache.evictable) == blocks[::-1]
    # a longer request finds all 3; the same prompt again finds 2: its last token must be computed
    assert bm.cached_prefix(tokens + [7], []) == blocks
    assert bm.cached_prefix(tokens, []) == blocks[:2]
    assert bm.cached_prefix(tokens[:4] + [0] * 8 + [1], []) == blocks[:1]  # a different second block
    assert bm.cached_prefix([0] + tokens, []) == []
    # starting on them takes them out of the evictable list (they count as used again)
    assert bm.blocks_needed(13, blocks) == 1 + 3 and bm.can_allocate(13, blocks)
    bm.allocate("b", 13, shared=blocks)
    assert bm.block_table("b").block_ids[:3] == blocks and bm.num_cached_free_blocks == 0
    assert bm.num_free_blocks == 4
    check_pool(bm)
    with pytest.raises(InvalidArgumentError, match="whole blocks"):
        bm.allocate("c", 7, shared=blocks[:2])
    with pytest.raises(InvalidArgumentError, match="distinct"):
        bm.allocate("c", 8, shared=blocks[:1] * 2)
    check_pool(bm)  # the refused calls changed nothing


def test_eviction_least_recently_used_tail_first_and_no_stale_hit():
    bm = _cached_manager(num_blocks=6)
    first, second = list(range(100, 108)), list(range(200, 208))
    _run_seq(bm, "a", first)
    _run_seq(bm, "b", second)
    a_blocks, b_blocks = bm.block_table("a").block_ids, bm.block_table("b").block_ids
    bm.free("a")
    bm.free("b")  # LRU order: a's tail, a's head, b's tail, b's head
    assert bm.allocator.num_free_blocks == 2 and bm.num_free_blocks == 6
    bm.allocate("c", 12)  # 3 blocks: the 2 plainly free ones, then evicts a's tail
    assert set(bm.block_table("c").block_ids) >= {a_blocks[1]}
    assert not bm.prefix_cache.is_cached(a_blocks[1]) and bm.prefix_cache.is_cached(a_blocks[0])
    check_pool(bm)
    # c overwrites that page: asking for a's prefix again finds only a's head, never c's tokens
    bm.cache_full_blocks("c", list(range(300, 312)), [], 0, 12)
    assert bm.cached_prefix(first + [1], []) == a_blocks[:1]
    assert bm.cached_prefix(second + [1], []) == b_blocks
    bm.allocate("d", 8)  # evicts a's head, then b's tail (least recently used first)
    assert not bm.prefix_cache.is_cached(a_blocks[0]) and not bm.prefix_cache.is_cached(b_blocks[1])
    assert bm.cached_prefix(second + [1], []) == b_blocks[:1]
    check_pool(bm)


def test_append_that_cannot_fit_evicts_nothing():
    """An append too large for the pool fails before it evicts: the cached blocks stay cached."""
    bm = _cached_manager(num_blocks=6)
    _run_seq(bm, "a", list(range(8)))  # 2 full blocks, cached
    bm.free("a")  # both stay cached but free
    bm.allocate("b", 3)  # 1 block: 3 free blocks + 2 cached = 5 free
    assert bm.num_cached_free_blocks == 2 and bm.num_free_blocks == 5
    with pytest.raises(OutOfBlocksError, match="needs 6 new blocks"):
        bm.append("b", 1 + 6 * BS)  # fills its block, then 6 more: one too many
    assert bm.num_cached_free_blocks == 2 and bm.num_free_blocks == 5 and bm.seq_len("b") == 3
    check_pool(bm)
    bm.append("b", 1 + 5 * BS)  # exactly fits: evicts both cached blocks
    assert bm.num_cached_free_blocks == 0 and bm.num_free_blocks == 0
    check_pool(bm)


def test_in_use_block_is_never_evicted():
    bm = _cached_manager(num_blocks=4)
    _run_seq(bm, "a", list(range(8)))
    assert not bm.can_allocate(12)  # a's 2 blocks are held: only 2 are free
    bm.allocate("b", 8)
    assert bm.num_free_blocks == 0 and bm.prefix_cache.num_cached_blocks == 2
    check_pool(bm)


def test_a_hash_collision_cannot_hand_out_another_prefix(monkeypatch):
    monkeypatch.setattr(pc, "block_hash", lambda parent, ids: b"same")  # every block collides
    bm = _cached_manager()
    _run_seq(bm, "a", [1, 2, 3, 4, 5])
    bm.free("a")
    assert bm.cached_prefix([9, 9, 9, 9, 5], []) == []  # same hash, other tokens: a miss
    assert len(bm.cached_prefix([1, 2, 3, 4, 5], [])) == 1


def test_restore_forgets_blocks_evicted_since_the_snapshot():
    """A rolled-back step may have written into a page it took by eviction: that page must not come
    back under its old name."""
    bm = _cached_manager(num_blocks=3)
    _run_seq(bm, "a", list(range(8)))
    head, tail = bm.block_table("a").block_ids
    bm.free("a")
    snap = bm.snapshot()
    bm.allocate("b", 10)  # takes the free block and evicts both cached ones
    assert bm.prefix_cache.num_cached_blocks == 0
    bm.restore(snap)
    assert len(bm) == 0 and bm.num_free_blocks == 3 and bm.prefix_cache.num_cached_blocks == 0
    assert bm.cached_prefix(list(range(8)) + [1], []) == []
    check_pool(bm)
    # blocks not evicted by the undone step keep their names
    _run_seq(bm, "a", list(range(8)))
    bm.free("a")
    snap = bm.snapshot()
    bm.allocate("b", 4)  # the plainly free block: nothing evicted
    bm.restore(snap)
    assert len(bm.cached_prefix(list(range(8)) + [1], [])) == 2
    check_pool(bm)


def test_prefix_caching_flag_is_checked():
    with pytest.raises(InvalidTypeError, match="enable_prefix_caching must be a bool"):
        BlockManager(4, 4, enable_prefix_caching=1)
    assert BlockManager(4, 4).cached_prefix([1] * 9, []) == []


@settings(max_examples=150, deadline=None)
# a failed step evicts the tail of a cached prompt; asked again, the prompt must not find it
@example(num_blocks=3, block_size=2, ops=[("start", 0, 0), ("free", 0, 0), ("fail", 1, 0), ("start", 0, 0)])
# ... and a request that evicts it for good, writing its own tokens there
@example(num_blocks=3, block_size=2, ops=[("start", 0, 0), ("free", 0, 0), ("start", 1, 0), ("start", 0, 0)])
@given(
    num_blocks=st.integers(3, 10),
    block_size=st.sampled_from([1, 2, 3]),
    ops=st.lists(
        st.tuples(st.sampled_from(["start", "grow", "free", "fail"]), st.integers(0, 5), st.integers(0, 9)),
        max_size=40,
    ),
)
def test_cached_blocks_always_hold_their_prefix(num_blocks, block_size, ops):
    """A fake KV cache whose slot holds the whole prefix up to its token (as real K/V depend on it).
    Random starts (on the longest cached prefix), growth, frees, and failed steps that write garbage
    and are rolled back: every hit must hold exactly the requester's prefix, and the pool stay sound."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    bs, kv, seqs, next_id = block_size, {}, {}, 0
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9], [7, 7, 7, 7, 7, 7, 7], [1, 2], [5]]

    def write(seq_id, tokens, start, garbage=False):
        for src, dst in bm.take_pending_copies():  # copy-on-write, before the writes
            for j in range(bs):
                if src * bs + j in kv:
                    kv[dst * bs + j] = kv[src * bs + j]
        for t, slot in enumerate(bm.slot_mapping(seq_id, start), start):
            kv[slot] = "garbage" if garbage else tuple(tokens[: t + 1])

    def commit(seq_id):
        tokens, hashes = seqs[seq_id]
        bm.cache_full_blocks(seq_id, tokens, hashes, 0, len(tokens))

    for op, a, b in ops:
        live = sorted(seqs)
        if op in ("start", "fail"):
            tokens = prompts[a % len(prompts)] + [b] * (a // 2)
            hashes = []
            hits = bm.cached_prefix(tokens, hashes)
            for i, block in enumerate(hits):  # what a hit block holds is exactly our prefix
                assert [kv.get(block * bs + j) for j in range(bs)] == [
                    tuple(tokens[: i * bs + j + 1]) for j in range(bs)
                ]
            if not bm.can_allocate(len(tokens), hits):
                continue
            snap = bm.snapshot() if op == "fail" else None
            bm.allocate(next_id, len(tokens), shared=hits)
            if op == "fail":  # the forward wrote into the new pages, then the step was rolled back
                write(next_id, tokens, len(hits) * bs, garbage=True)
                bm.restore(snap)
                continue
            seqs[next_id] = (tokens, hashes)
            write(next_id, tokens, len(hits) * bs)
            commit(next_id)
            next_id += 1
        elif op == "grow" and live:
            seq_id = live[a % len(live)]
            tokens, _ = seqs[seq_id]
            if bm.can_append(seq_id, 1):
                bm.append(seq_id, 1)
                tokens.append(b)
                write(seq_id, tokens, len(tokens) - 1)
                commit(seq_id)
        elif op == "free" and live:
            bm.free(live[a % len(live)])
            del seqs[live[a % len(live)]]
        check_pool(bm)
    for seq_id in list(seqs):
        bm.free(seq_id)
    check_pool(bm)
    assert bm.num_free_blocks == num_blocks and len(bm) == 0


# -----------------------------------------------------------------------------
# the engine: a tiny Llama against transformers


@pytest.fixture(scope="module")
def greedy_ref(hf64):
    """Greedy tokens and top-2 gaps of transformers in float64, memoized per prompt."""
    return cache(lambda prompt, max_tokens: greedy_reference(hf64, prompt, max_tokens))


_g = torch.Generator().manual_seed(11)
SYSTEM = torch.randint(3, 128, (13,), generator=_g).tolist()  # 3 full blocks + 1 token
QUESTIONS = [torch.randint(3, 128, (n,), generator=_g).tolist() for n in (3, 5, 1, 7)]
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


def _finish(engine, bm_check=True):
    """Step an engine until done, checking the pool after every step; outputs by request id."""
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step())
        if bm_check:
            check_pool(engine.scheduler.block_manager)
    bm = engine.scheduler.block_manager
    assert len(bm) == 0 and bm.num_free_blocks == bm.num_blocks  # everything came back
    return outputs


def test_prefix_caching_matches_transformers_and_saves_prefill(model, greedy_ref):
    """Requests that share a system prompt: the later ones compute only their own question. Covers a
    prompt that is a whole multiple of block_size and a prompt that is entirely cached."""
    prompts = [SYSTEM + q for q in QUESTIONS]
    prompts += [SYSTEM[:12], SYSTEM[:12], SYSTEM + QUESTIONS[0]]  # 3 whole blocks, twice; a repeat
    engine = LLMEngine(model, block_size=BS, num_blocks=64, enable_prefix_caching=True)
    first = engine.generate(prompts[:1], GREEDY, use_tqdm=False)
    rest = engine.generate(prompts[1:], GREEDY, use_tqdm=False)
    full = sum(
        assert_greedy(o.output_token_ids, greedy_ref(tuple(p), 8))
        for o, p in zip(first + rest, prompts, strict=True)
    )
    assert full >= len(prompts) - 1
    admitted = engine.stats[len(first[0].output_token_ids)]  # the step that admitted the rest
    # each of the 6 later prompts finds the system prompt's 3 full blocks (the 12-token ones: 2 of
    # their 3, since their last token is computed); all of them were admitted in one step
    assert admitted.num_prefills == 6 and admitted.num_hit_blocks == 4 * 3 + 2 + 2
    assert admitted.num_hit_tokens == 16 * BS
    assert admitted.num_prefill_tokens == sum(len(p) for p in prompts[1:]) - 16 * BS
    summary = sharing_summary(engine.stats)
    assert summary["cached_tokens"] == 16 * BS and 0 < summary["token_hit_rate"] < 1
    # the same run without caching computes every prompt token
    plain = LLMEngine(model, block_size=BS, num_blocks=64)
    plain.generate(prompts[:1], GREEDY, use_tqdm=False)
    again = plain.generate(prompts[1:], GREEDY, use_tqdm=False)
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in rest]
    assert sharing_summary(plain.stats)["prefill_tokens"] == sum(map(len, prompts))
    assert sharing_summary(plain.stats)["token_hit_rate"] == 0.0


def test_fully_cached_prompt_still_computes_its_last_token(model, greedy_ref):
    for prompt in (SYSTEM[:12], SYSTEM[:13]):  # a whole multiple of block_size, and one more token
        engine = LLMEngine(model, block_size=BS, num_blocks=32, enable_prefix_caching=True)
        a = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
        b = engine.generate([prompt], GREEDY, use_tqdm=False)[0]
        assert a.output_token_ids == b.output_token_ids
        assert_greedy(b.output_token_ids, greedy_ref(tuple(prompt), 8))
        second = engine.stats[len(a.output_token_ids)]
        assert second.num_prefill_tokens == len(prompt) - (len(prompt) - 1) // BS * BS  # 4 or 1
        assert second.num_hit_blocks == (len(prompt) - 1) // BS


def test_evicted_page_reused_then_the_prefix_asked_again(model, greedy_ref):
    engine = LLMEngine(model, block_size=BS, num_blocks=8, watermark=0.0, enable_prefix_caching=True)
    bm = engine.scheduler.block_manager
    p1, p2 = SYSTEM[:9], QUESTIONS[3] * 3  # 9 and 21 tokens
    out1 = engine.generate([p1], GREEDY, use_tqdm=False)[0]
    assert bm.num_cached_free_blocks == 4  # p1's 9 + 7 computed tokens
    engine.generate([p2], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # needs 7 pages
    # p2 took p1's tail pages (least recently used first) and wrote its own tokens there; only p1's
    # head is still cached, and asking for p1 again must not find p2's K/V in p1's second block
    assert len(bm.cached_prefix(p1, [])) == 1 and bm.num_cached_free_blocks == 8
    out3 = engine.generate([p1], GREEDY, use_tqdm=False)[0]
    assert out3.output_token_ids == out1.output_token_ids
    assert_greedy(out3.output_token_ids, greedy_ref(tuple(p1), 8))


def test_parallel_sampling_equals_independent_requests(model):
    prompt = SYSTEM[:10]  # 2 full blocks + a shared partial one
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=5, n=4, ignore_eos=True)
    engine = LLMEngine(model, block_size=BS, num_blocks=64)
    calls = []
    original = engine.kv_cache.copy_blocks
    engine.kv_cache.copy_blocks = lambda pairs: calls.append(list(pairs)) or original(pairs)
    out = engine.generate([prompt], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert (out.output_token_ids, out.finish_reason) == (out.outputs[0].token_ids, "length")
    for i, c in enumerate(out.outputs):  # sample i = a request alone with the derived seed
        alone = SamplingParams(max_tokens=8, temperature=1.0, seed=sample_seed(5, i), ignore_eos=True)
        ref = LLMEngine(model, block_size=BS, num_blocks=64).generate([prompt], alone, use_tqdm=False)
        assert c.token_ids == ref[0].output_token_ids
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4  # four different streams
    assert sample_seed(5, 0) == 5
    # the prompt was computed once; the partial block copied once per writer but the last, in one call
    first, second = engine.stats[:2]
    assert first.num_prefill_tokens == 10 and first.num_generated == 4 and first.num_prefills == 1
    assert (first.used_blocks, first.logical_blocks, first.shared_blocks) == (3, 12, 3)
    assert second.num_copies == 3 and [len(c) for c in calls if c] == [3]
    assert (second.used_blocks, second.logical_blocks, second.shared_blocks) == (6, 12, 2)
    assert first.memory_saved == 0.75 and second.memory_saved == 0.5
    assert sharing_summary(engine.stats)["copies"] == 3


def test_greedy_samples_are_identical_and_match_transformers(model, greedy_ref):
    prompt = SYSTEM[:6]
    out = LLMEngine(model, block_size=BS, num_blocks=32).generate(
        [prompt], SamplingParams(max_tokens=8, n=3, ignore_eos=True), use_tqdm=False
    )[0]
    assert all(c.token_ids == out.outputs[0].token_ids for c in out.outputs)
    assert_greedy(out.output_token_ids, greedy_ref(tuple(prompt), 8))


def test_group_preempted_and_recomputed(model):
    """A pool too small for every group: whole groups are preempted and recomputed, the siblings
    sharing the first sample's blocks as far as their tokens agree. Each sample equals its run alone."""
    prompts = [SYSTEM[:7], SYSTEM[3:12], QUESTIONS[3] + SYSTEM[:2]]
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=s, n=3, ignore_eos=True) for s in (1, 2, 3)]
    engine = LLMEngine(model, block_size=BS, num_blocks=20, watermark=0.0)
    for p, sp in zip(prompts, params, strict=True):
        engine.add_request(p, sp)
    outputs = _finish(engine)
    assert engine.num_preemptions >= 3 and engine.num_preemptions % 3 == 0  # whole groups
    big = LLMEngine(model, block_size=BS, num_blocks=128)
    expected = big.generate(prompts, params, use_tqdm=False)
    assert big.num_preemptions == 0
    for rid, exp in enumerate(expected):
        assert [c.token_ids for c in outputs[rid].outputs] == [c.token_ids for c in exp.outputs]
    assert sum(s.num_generated for s in engine.stats) == 3 * 3 * 10


def test_failures_rolled_back_with_sharing(model):
    """Every step's first forward fails after writing the cache; with n > 1, prefix caching and a pool
    that preempts and evicts, the retried run equals the clean one, step for step."""
    requests = [
        (SYSTEM + QUESTIONS[0], SamplingParams(max_tokens=6, n=2, temperature=0.9, seed=1, ignore_eos=True)),
        (SYSTEM + QUESTIONS[1], SamplingParams(max_tokens=7, ignore_eos=True)),
        (SYSTEM[:12], SamplingParams(max_tokens=5, n=3, ignore_eos=True)),
        (QUESTIONS[3], SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=4, ignore_eos=True)),
    ]

    def run(fail: bool):
        engine = LLMEngine(model, block_size=BS, num_blocks=16, watermark=0.0, enable_prefix_caching=True)
        engine.generate([SYSTEM + [5]], SamplingParams(max_tokens=2), use_tqdm=False)  # warm the cache
        for p, sp in requests:
            engine.add_request(p, sp)
        outputs, failures = {}, 0
        with fails_once_per_step(engine, enabled=fail):
            while engine.has_unfinished_requests():
                try:
                    outputs.update((o.request_id, o) for o in engine.step())
                except RuntimeError:
                    failures += 1
                check_pool(engine.scheduler.block_manager)
        fields = ("num_prefills", "num_decodes", "num_preemptions", "used_blocks", "num_hit_tokens")
        steps = [tuple(getattr(s, f) for f in fields) for s in engine.stats]
        return {i: [c.token_ids for c in o.outputs] for i, o in outputs.items()}, steps, failures

    clean_out, clean_steps, _ = run(False)
    assert any(s[2] for s in clean_steps) and any(s[4] for s in clean_steps)  # preempts; hits the cache
    out, steps, failures = run(True)
    assert failures == len(steps) - 2  # every step of the run (the warm-up ran before)
    assert (out, steps) == (clean_out, clean_steps)


def test_abort_returns_every_sample(model):
    engine = LLMEngine(model, block_size=BS, num_blocks=32)
    rid = engine.add_request(SYSTEM[:5], SamplingParams(max_tokens=8, n=3, temperature=1.0, seed=0))
    engine.step()
    engine.step()
    assert engine.abort_request(rid) and not engine.abort_request(rid)
    (out,) = engine.step()
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 3 and out.finish_reason == "abort"
    assert all(len(c.token_ids) == 2 for c in out.outputs)
    assert engine.scheduler.block_manager.num_free_blocks == 32


def test_sharing_options_are_checked(model, hf):
    with pytest.raises(InvalidArgumentError, match="n"):
        SamplingParams(n=0)
    with pytest.raises(InvalidTypeError, match="n"):
        SamplingParams(n=2.0)
    engine = LLMEngine(model, block_size=BS, num_blocks=16, max_num_seqs=4)
    with pytest.raises(InvalidArgumentError, match="n=5 samples needs 5 sequences.*max_num_seqs=4"):
        engine.add_request([5, 6], SamplingParams(n=5))
    # alone each sample fits in 16 blocks; four of them never can (the prompt's blocks are shared)
    with pytest.raises(InvalidArgumentError, match="n=4 samples needs 34 blocks"):
        engine.add_request(list(range(3, 11)), SamplingParams(n=4, max_tokens=32))
    assert not engine.has_unfinished_requests()
    with pytest.raises(InvalidArgumentError, match="policy 'paged'"):
        LLMEngine(model, block_size=BS, num_blocks=16, policy="static", enable_prefix_caching=True)
    loaded = LLMEngine.from_pretrained(hf, num_blocks=8, block_size=BS, enable_prefix_caching=True)
    assert loaded.config.enable_prefix_caching and loaded.scheduler.block_manager.prefix_cache is not None


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("policy", ["static", "oracle"])
def test_static_policies_run_n_samples_without_sharing(model, policy, chunked):
    """Each sample reserves and computes its own prompt (with chunked prefill too: a sample that shares
    no block must not wait for, or sample from, the first one's prefill)."""
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=3, n=2, ignore_eos=True)
    paged = LLMEngine(model, block_size=BS, num_blocks=32, enable_chunked_prefill=False).generate(
        [SYSTEM[:6]], params, use_tqdm=False
    )
    kw = dict(max_model_len=16, policy=policy, enable_chunked_prefill=chunked)
    engine = LLMEngine(model, block_size=BS, num_blocks=32, **kw)
    out = engine.generate([SYSTEM[:6]], params, use_tqdm=False)
    assert [c.token_ids for c in out[0].outputs] == [c.token_ids for c in paged[0].outputs]
    assert engine.stats[0].shared_blocks == 0 and engine.stats[0].num_prefills == 2


# -----------------------------------------------------------------------------
# random mixes: shared prefixes, n > 1, preemption and eviction in a tiny pool


PREFIXES = [SYSTEM[:8], SYSTEM[:5], QUESTIONS[3][:3]]
SUFFIXES = [[], QUESTIONS[2], QUESTIONS[0], QUESTIONS[0][:2] + QUESTIONS[2] + [9]]


@settings(max_examples=25, deadline=None)
@given(
    block_size=st.sampled_from([2, 4]),
    num_blocks=st.integers(8, 16),
    requests=st.lists(
        st.tuples(
            st.integers(0, 2), st.integers(0, 3), st.integers(1, 3), st.integers(1, 6), st.integers(0, 1)
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_random_mixes_match_with_and_without_caching(model, greedy_ref, block_size, num_blocks, requests):
    runs = {}
    for caching in (False, True):
        engine = LLMEngine(
            model,
            block_size=block_size,
            num_blocks=num_blocks,
            watermark=0.0,
            enable_prefix_caching=caching,
        )
        added = []  # (request id, prompt, max_tokens, n)
        for wave in (0, 1):
            for pre, suf, n, max_tokens, w in requests:
                if w != wave:
                    continue
                prompt = PREFIXES[pre] + SUFFIXES[suf]
                try:
                    rid = engine.add_request(
                        prompt, SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)
                    )
                except InvalidArgumentError:  # could never fit this pool
                    continue
                added.append((rid, prompt, max_tokens, n))
            if wave == 0:  # the second wave arrives two steps later
                done = {}
                for _ in range(2):
                    if engine.has_unfinished_requests():
                        done.update((o.request_id, o) for o in engine.step())
                    check_pool(engine.scheduler.block_manager)
        done.update(_finish(engine))
        assert sorted(done) == [r[0] for r in added]
        runs[caching] = {}
        for rid, prompt, _, n in added:
            o = done[rid]
            assert len(o.outputs) == n and all(c.token_ids == o.outputs[0].token_ids for c in o.outputs)
            assert_greedy(o.output_token_ids, greedy_ref(tuple(prompt), 6))
            runs[caching][rid] = o.output_token_ids
    for rid, tokens in runs[True].items():  # on and off agree, but where a near-tie lets them part
        other = runs[False][rid]
        if tokens != other:
            diff = next(t for t in range(len(tokens)) if tokens[t] != other[t])
            prompt = next(p for r, p, _, _ in added if r == rid)
            assert greedy_ref(tuple(prompt), 6)[1][diff] < TIE
