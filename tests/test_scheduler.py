"""vllmini.scheduler alone (no model): no request lost or duplicated whatever the pool, a step undone
exactly, duplicate requests refused, aborts, and its argument checks."""

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllmini.engine import EngineConfig
from vllmini.errors import EngineStateError, InvalidArgumentError, InvalidTypeError
from vllmini.model_runner import prepare_inputs
from vllmini.scheduler import Scheduler
from vllmini.sequence import Sequence, SequenceStatus


def make_scheduler(num_blocks, block_size, max_model_len, **options):
    """A Scheduler over `num_blocks` blocks; `options`: EngineConfig's (chunked prefill off unless asked)."""
    options.setdefault("enable_chunked_prefill", False)
    return Scheduler(EngineConfig(block_size=block_size, max_model_len=max_model_len, **options), num_blocks)


# -----------------------------------------------------------------------------
# no request lost or duplicated, whatever the pool


@given(
    num_blocks=st.integers(4, 24),
    block_size=st.sampled_from([1, 2, 4]),
    policy=st.sampled_from(["paged", "static", "oracle"]),
    requests=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=12),
    seed=st.integers(0, 1000),
)
def test_scheduler_never_loses_or_duplicates(num_blocks, block_size, policy, requests, seed):
    max_model_len = 24
    if policy == "static" and -(-max_model_len // block_size) > num_blocks:
        with pytest.raises(ValueError, match="static"):
            make_scheduler(num_blocks, block_size, max_model_len, policy=policy, watermark=0.0)
        return
    sched = make_scheduler(
        num_blocks, block_size, max_model_len, policy=policy, watermark=0.0, max_num_seqs=5
    )
    rng = random.Random(seed)
    seqs = []
    for i, (n_prompt, n_out) in enumerate(requests):
        seq = Sequence(i, [1] * n_prompt, n_out, seed=0)
        try:
            sched.add(seq)
            seqs.append(seq)
        except ValueError:
            assert -(-(n_prompt + n_out - 1) // block_size) > num_blocks or policy != "paged"
    finished = []
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert not out.is_empty
        batch = [s.seq_id for s in out.seqs]
        assert len(batch) == len(set(batch)) <= 5
        assert len(out.slot_mapping) == len(set(out.slot_mapping))  # no two tokens share a slot
        assert all(s.status is SequenceStatus.RUNNING for s in out.seqs)
        assert {s.seq_id for s in sched.running} == set(batch)
        assert not {s.seq_id for s in sched.waiting} & set(batch)
        input_ids, positions, meta = prepare_inputs(out, sched.block_manager)
        assert input_ids.shape == positions.shape == (len(out.slot_mapping),)
        for seq in out.seqs:
            seq.output_token_ids.append(rng.randrange(100))
            if len(seq.output_token_ids) == seq.max_tokens or rng.random() < 0.05:
                sched.finish(seq, "length")
                finished.append(seq.seq_id)
    assert not sched.has_unfinished()
    assert sorted(finished) == [s.seq_id for s in seqs]
    assert sched.block_manager.num_free_blocks == num_blocks
    if policy != "paged":
        assert sched.num_preemptions == 0


# -----------------------------------------------------------------------------
# undoing a step


def state(sched: Scheduler):
    """Everything schedule() may change, as plain values."""
    bm, a = sched.block_manager, sched.block_manager.allocator
    return (
        [s.seq_id for s in sched.waiting],
        [s.seq_id for s in sched.running],
        {s.seq_id: (s.status, s.num_preemptions, s.num_tokens) for s in [*sched.waiting, *sched.running]},
        sched.num_preemptions,
        {s: (bm.block_table(s).block_ids, bm.seq_len(s)) for s in bm.seq_ids},
        a.free_block_ids,
        [a.ref_count(b) for b in range(a.num_blocks)],
    )


def batch(out):
    return (
        [s.seq_id for s in out.prefills],
        [s.seq_id for s in out.decodes],
        [s.seq_id for s in out.preempted],
        out.slot_mapping,
    )


@given(
    num_blocks=st.integers(4, 16),
    block_size=st.sampled_from([1, 2, 4]),
    policy=st.sampled_from(["paged", "oracle"]),
    requests=st.lists(st.tuples(st.integers(1, 10), st.integers(1, 10)), min_size=1, max_size=10),
    seed=st.integers(0, 1000),
)
def test_restore_undoes_a_step_and_the_retry_is_the_same_step(num_blocks, block_size, policy, requests, seed):
    sched = make_scheduler(num_blocks, block_size, 24, policy=policy, watermark=0.0, max_num_seqs=4)
    rng = random.Random(seed)
    for i, (n_prompt, n_out) in enumerate(requests):
        if -(-(n_prompt + n_out) // block_size) <= num_blocks:
            sched.add(Sequence(i, [1] * n_prompt, n_out, seed=0))
    for _ in range(500):
        if not sched.has_unfinished():
            break
        before = state(sched)
        snapshot = sched.snapshot()
        first = batch(sched.schedule())
        sched.restore(snapshot)  # as after a failed forward that never ran
        assert state(sched) == before
        out = sched.schedule()
        assert batch(out) == first
        if rng.random() < 0.3:  # undo twice from the same snapshot
            sched.restore(snapshot)
            assert state(sched) == before
            out = sched.schedule()
            assert batch(out) == first
        for seq in out.seqs:
            seq.output_token_ids.append(1)
            if len(seq.output_token_ids) == seq.max_tokens:
                sched.finish(seq, "length")
    assert not sched.has_unfinished() and sched.block_manager.num_free_blocks == num_blocks


def test_a_stale_sequence_is_recomputed_unless_preempted_anyway():
    sched = make_scheduler(8, 2, 24, watermark=0.0)
    a, b = Sequence(0, [1] * 3, 5, seed=0), Sequence(1, [1] * 3, 5, seed=0)
    sched.add(a)
    sched.add(b)
    sched.schedule()  # both prefill: 2 blocks each
    snapshot = sched.snapshot()
    sched.schedule()  # (as if this forward failed after writing into b's blocks)
    sched.restore(snapshot, stale=[b])
    out = sched.schedule()  # the retry does not need b's blocks, but b's KV may be garbage
    assert [s.seq_id for s in out.decodes] == [0] and [s.seq_id for s in out.preempted] == [1]
    assert b.status is SequenceStatus.WAITING and b.num_preemptions == 1
    assert not sched._stale  # recomputed once, then an ordinary sequence again


@pytest.mark.parametrize("policy", ["paged", "static", "oracle"])
@pytest.mark.parametrize("num_blocks", [40, 9])  # 9: too few for all, so some steps preempt (paged)
def test_each_decode_writes_the_slot_of_its_last_token(policy, num_blocks):
    """slot_mapping holds the prefills' chunks, then each decode's last token's slot: taken in the step
    (paged, with or without free blocks for every one) or reserved at admission (static policies)."""
    sched = make_scheduler(num_blocks, 2, 16, policy=policy, watermark=0.0)
    for i in range(4):
        sched.add(Sequence(i, [1] * (2 + i), 6, seed=0))
    bm = sched.block_manager
    for _ in range(12):
        out = sched.schedule()
        want = [s for p in out.prefills for s in bm.slot_mapping(p.seq_id, 0, p.num_tokens)]
        want += [bm.slot_mapping(s.seq_id, s.num_tokens - 1, s.num_tokens)[0] for s in out.decodes]
        assert out.slot_mapping == want
        for seq in out.seqs:
            seq.num_computed_tokens = seq.num_tokens  # as the engine's commit marks them
            seq.output_token_ids.append(7)
            if len(seq.output_token_ids) == seq.max_tokens:
                sched.finish(seq, "length")


# -----------------------------------------------------------------------------
# requests in and out


def test_add_refuses_a_duplicate_id_or_a_used_sequence():
    sched = make_scheduler(8, 2, 24)
    seq = Sequence(0, [1, 2], 3, seed=0)
    sched.add(seq)
    with pytest.raises(InvalidArgumentError, match="seq_id 0 is already queued or running"):
        sched.add(Sequence(0, [3], 3, seed=0))
    with pytest.raises(InvalidArgumentError, match="already queued"):
        sched.add(seq)
    assert list(sched.waiting) == [seq]
    out = sched.schedule()  # no half-admitted duplicate: every step works
    assert [s.seq_id for s in out.prefills] == [0]
    seq.output_token_ids += [5, 5, 5]
    sched.finish(seq, "length")
    with pytest.raises(InvalidArgumentError, match="only a new sequence can be added"):
        sched.add(seq)  # it already ran
    with pytest.raises(EngineStateError, match="only running sequences can finish"):
        sched.finish(seq, "length")
    sched.add(Sequence(0, [3], 3, seed=0))  # its id is free again once it finished
    assert sched.schedule().prefills[0].prompt_token_ids == [3]


def test_abort_waiting_and_running():
    sched = make_scheduler(4, 2, 24, watermark=0.0)
    seqs = [Sequence(i, [1] * 3, 4, seed=0) for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.schedule()  # 0 and 1 run (2 blocks each), 2 waits
    assert sched.block_manager.num_free_blocks == 0
    assert sched.abort(0) is seqs[0] and sched.abort(2) is seqs[2]
    assert sched.abort(0) is None and sched.abort(7) is None
    assert [s.finish_reason for s in seqs] == ["abort", None, "abort"]
    assert seqs[0].status is SequenceStatus.FINISHED and sched.block_manager.num_free_blocks == 2
    assert [s.seq_id for s in sched.running] == [1] and not sched.waiting
    assert [s.seq_id for s in sched.schedule().decodes] == [1]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(num_blocks=0), InvalidArgumentError, "num_blocks must be >= 1"),
        (dict(block_size=0), InvalidArgumentError, "block_size must be >= 1"),
        (dict(block_size=2.0), InvalidTypeError, "block_size must be an int"),
        (dict(max_model_len=0), InvalidArgumentError, "max_model_len must be >= 1"),
        (dict(policy="lazy"), InvalidArgumentError, "policy must be one of"),
        (dict(watermark=1.0), InvalidArgumentError, "watermark"),
        (dict(max_num_seqs=True), InvalidTypeError, "max_num_seqs"),
        (dict(max_num_batched_tokens=0), InvalidArgumentError, "max_num_batched_tokens"),
    ],
)
def test_scheduler_argument_checks(kwargs, error, message):
    args = dict(num_blocks=8, block_size=2, max_model_len=24) | kwargs
    with pytest.raises(error, match=message):
        make_scheduler(args.pop("num_blocks"), args.pop("block_size"), args.pop("max_model_len"), **args)
    with pytest.raises(InvalidArgumentError, match="needs config.max_model_len"):
        Scheduler(EngineConfig(), 8)
    with pytest.raises(InvalidArgumentError, match="max_tokens must be >= 1"):
        Sequence(0, [1], 0, seed=0)
    with pytest.raises(InvalidArgumentError, match="empty prompt"):
        Sequence(0, [], 1, seed=0)
