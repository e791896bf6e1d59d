"""Chunked prefill: which prompts compute a chunk in this step, and how much of the token budget it takes.

With enable_chunked_prefill a step never holds more than max_num_batched_tokens tokens. The scheduler
(vllmini/scheduler.py) gives running decodes their token first; then sequences still prefilling, oldest
first, and then newly admitted ones each take a chunk [num_computed_tokens, end) of what is left
(`schedule_chunks`). A request is admitted with blocks for all its tokens, so chunks never allocate or
preempt; a prefill that starts at k > 0 is the same mechanism prefix caching uses.
"""

from __future__ import annotations

from vllmini.sequence import SchedulerOutput, Sequence


def schedule_chunks(seqs: list[Sequence], budget: int, out: SchedulerOutput) -> int:
    """Give each of `seqs` (admitted, still prefilling, oldest first) its next chunk while `budget` tokens
    last; returns what is left. A sample that forks its first sample (same tokens) computes nothing: it
    samples from the first's logits in the step its prefill completes. One that shares the first's blocks
    reads them only once they are computed: the first comes before it, and a chunk goes to a later
    sequence only when the earlier ones got all they need (this step counts: a forward writes every K/V
    of a layer before any attention reads it)."""
    for seq in seqs:
        parent = seq.prefill_parent
        parent_end = None if parent is None else out.chunk_ends.get(parent.seq_id, parent.num_computed_tokens)
        if parent is not None and seq.token_ids == parent.token_ids:
            if parent_end == parent.num_tokens and any(p is parent for p in out.prefills):
                out.forked.append((seq, parent))
            continue
        if budget < 1:
            continue  # forks of a parent scheduled above still join
        assert parent_end is None or parent_end >= seq.num_computed_tokens, "shared blocks computed"
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        out.prefills.append(seq)
        out.chunk_ends[seq.seq_id] = seq.num_computed_tokens + n
        budget -= n
    return budget


def unreached_slots(running: list[Sequence], out: SchedulerOutput) -> int:
    """Slots allocated for prompt tokens of the `running` sequences that no chunk has reached by the end
    of the step `out` (a forked sample's are its first sample's)."""
    return sum(
        s.prefill_target - out.chunk_ends.get(s.seq_id, s.num_computed_tokens)
        for s in running
        if s.is_prefilling
        and not (s.prefill_parent is not None and s.token_ids == s.prefill_parent.token_ids)
    )
