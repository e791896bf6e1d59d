"""Continuous batching (notebook 06; sharing pages: notebook 08): which sequences run in each step.

Running sequences decode one token each; waiting requests are admitted (FCFS) while the pool keeps a
watermark of free blocks. A decode that finds no free block preempts the most recently admitted group *by
recomputation*: its blocks are freed and it waits again at the head of the queue. The n samples of a
request are admitted, forked (copy-on-write) and preempted together; with chunked prefill, prompts take
chunks of the token budget the decodes leave. `snapshot()` / `restore()` undo a failed step. POLICIES:
"paged" (vLLM) allocates as tokens arrive; "static" and "oracle" (Orca) reserve up front, never preempt.
"""

from __future__ import annotations

from collections import deque
from itertools import islice

from vllmini.block_manager import BlockManager
from vllmini.checks import as_int, cdiv, one_of
from vllmini.errors import EngineStateError, InvalidArgumentError
from vllmini.sequence import SchedulerOutput, Sequence, SequenceStatus, as_group

POLICIES = ("paged", "static", "oracle")


def check_policy(policy, enable_prefix_caching: bool = False) -> str:
    """`policy` if it is one of POLICIES and allows `enable_prefix_caching` (the one place for both)."""
    one_of(policy, "policy", POLICIES)
    if enable_prefix_caching and policy != "paged":
        raise InvalidArgumentError(f"enable_prefix_caching needs policy 'paged', got {policy!r}")
    return policy


class Scheduler:
    """Queues of waiting and running sequences over one `BlockManager`."""

    def __init__(self, config, num_blocks: int):
        """`config`: a checked EngineConfig (vllmini.engine), max_model_len set; `num_blocks`: the pool."""
        if config.max_model_len is None:
            raise InvalidArgumentError("the scheduler needs config.max_model_len, got None")
        num_blocks, block_size = as_int(num_blocks, "num_blocks", min=1), config.block_size
        policy, max_model_len = config.policy, config.max_model_len
        # reservations never grow, so static policies need no headroom
        watermark_blocks = int(config.watermark * num_blocks) if policy == "paged" else 0
        self.block_manager = BlockManager(
            num_blocks, block_size, watermark_blocks, config.enable_prefix_caching
        )
        if policy == "static" and cdiv(max_model_len, block_size) > num_blocks:
            raise InvalidArgumentError(
                f"policy 'static' reserves max_model_len={max_model_len} slots per request, but "
                f"the pool has only {num_blocks} blocks x {block_size} = {num_blocks * block_size}"
            )
        self.policy, self.block_size, self.max_model_len = policy, block_size, max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens or max(max_model_len, 2048)
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0
        self._live: dict = {}  # seq_id -> Sequence, waiting or running
        self._requests: dict = {}  # request_id -> its group, while any sample is waiting or running
        self._stale: set = set()  # seq_ids whose cached KV a failed forward may have overwritten
        self._admitted: list = []  # (sequence, its state) of this step's admissions, for `restore`

    def check_fits(self, seqs: Sequence | list[Sequence]) -> None:
        """InvalidArgumentError if a request (one sequence, or n samples) could never run, even alone."""
        group = [seqs] if isinstance(seqs, Sequence) else list(seqs)
        seq, n, bs = group[0], len(group), self.block_size
        if seq.max_len > self.max_model_len:
            raise InvalidArgumentError(
                f"prompt ({len(seq.prompt_token_ids)} tokens) + max_tokens ({seq.max_tokens}) = "
                f"{seq.max_len} exceeds max_model_len={self.max_model_len}"
            )
        if n > self.max_num_seqs:
            raise InvalidArgumentError(
                f"a request with n={n} samples needs {n} sequences, but max_num_seqs={self.max_num_seqs}"
            )
        bm = self.block_manager
        if self.policy == "paged":
            # the last sampled token is never written to the cache: each holds at most max_len - 1 tokens;
            # the prompt's full blocks are shared, every sample owns the rest
            shared = len(seq.prompt_token_ids) // bs
            need = shared + n * (cdiv(seq.max_len - 1, bs) - shared)
        else:
            need = n * cdiv(self._reserve(seq), bs)
        if need > bm.num_blocks - bm.watermark_blocks:
            what = "request" if n == 1 else f"request with n={n} samples"
            raise InvalidArgumentError(
                f"{what} needs {need} blocks of {bs} tokens, but the pool has {bm.num_blocks} blocks "
                f"({bm.watermark_blocks} held back as watermark): it could never fit"
            )

    def add(self, seqs: Sequence | list[Sequence]) -> None:
        """Queue a new request: one sequence, or the n samples of one prompt (one request_id)."""
        group = as_group(seqs)
        for seq in group:
            if seq.seq_id in self._live:
                raise InvalidArgumentError(
                    f"seq_id {seq.seq_id!r} is already queued or running: {self._live[seq.seq_id]}"
                )
        rid = group[0].request_id
        if rid in self._requests:
            raise InvalidArgumentError(f"request_id {rid!r} is already queued or running")
        self.check_fits(group)
        for seq in group:
            seq.group = group
            self.waiting.append(seq)
            self._live[seq.seq_id] = seq
        self._requests[rid] = group

    def finish(self, seq: Sequence, reason: str) -> None:
        """A running sequence is done: free its blocks."""
        if seq.status is not SequenceStatus.RUNNING or self._live.get(seq.seq_id) is not seq:
            raise EngineStateError(f"only running sequences can finish, got {seq}")
        self._retire(seq, reason)

    def abort(self, request_id) -> Sequence | None:
        """Stop every unfinished sample of a request; returns its first sample, or None if none was live."""
        group = self._requests.get(request_id, [])
        live = [s for s in group if self._live.get(s.seq_id) is s]
        for seq in live:
            self._retire(seq, "abort")
        return group[0] if live else None

    def _retire(self, seq: Sequence, reason: str) -> None:
        """Take `seq` out of the queues for good (freeing its blocks)."""
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.free(seq.seq_id)  # first: if it fails, the sequence is still running
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        del self._live[seq.seq_id]
        if all(s.seq_id not in self._live for s in seq.group):
            del self._requests[seq.request_id]
        self._stale.discard(seq.seq_id)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def snapshot(self) -> tuple:
        """Everything a step changes: queues, sequences (their samples too), preemptions, blocks. Waiting
        sequences are saved as `_admit` takes them (into `_admitted`, which `schedule` empties first)."""
        seqs = dict.fromkeys(x for s in self.running for x in s.group)
        return (
            list(self.waiting),
            list(self.running),
            [(s, s.snapshot()) for s in seqs],
            self._admitted,
            self.num_preemptions,
            self.block_manager.snapshot(),
            (dict(self._live), dict(self._requests), set(self._stale)),
        )

    def restore(self, snapshot: tuple, stale=()) -> None:
        """Undo everything since `snapshot()`. `stale`: sequences preempted in the failed step (their
        blocks may hold its writes): recomputed unless preempted again."""
        waiting, running, seqs, admitted, num_preemptions, blocks, (live, requests, stale_ids) = snapshot
        self.waiting, self.running = deque(waiting), list(running)
        for seq, state in [*seqs, *admitted]:
            seq.restore(state)
        self.num_preemptions = num_preemptions
        self._live, self._requests, self._stale = dict(live), dict(requests), set(stale_ids)
        self.block_manager.restore(blocks)
        self._stale.update(s.seq_id for s in stale if s.status is SequenceStatus.RUNNING)

    def _reserve(self, seq: Sequence) -> int:
        """Slots a static policy reserves for `seq` at admission."""
        return self.max_model_len if self.policy == "static" else seq.max_len

    def _admit_tokens(self, seq: Sequence) -> int:
        """Slots `seq` takes when admitted: its tokens (paged), or its reservation."""
        return seq.num_tokens if self.policy == "paged" else self._reserve(seq)

    def stall_message(self) -> str:
        """Why nothing can be scheduled although requests wait (the engine's no-progress error)."""
        bm, head = self.block_manager, self.waiting[0]
        group = [s for s in head.group if s.status is SequenceStatus.WAITING]
        need = self._plan_admission(group)[2]
        samples = f", {len(group)} samples" if len(group) > 1 else ""
        return (
            f"request {head.request_id} ({head.num_tokens} tokens{samples}, {need} blocks) cannot be "
            f"scheduled with nothing running: {bm.num_free_blocks} of {bm.num_blocks} blocks free, "
            f"{bm.watermark_blocks} held back as watermark"
        )

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch, allocating or reserving the slots its new tokens go to."""
        out = SchedulerOutput()
        self._admitted.clear()  # this step's admissions only (none pile up when no snapshot() is taken)
        decode_slots = self._schedule_decodes(out)
        self._schedule_admissions(out)
        bm, spans = self.block_manager, out.spans[: len(out.prefills)]  # the decodes' slots come next
        for seq, (start, end) in zip(out.prefills, spans, strict=True):
            out.slot_mapping += bm.slot_mapping(seq.seq_id, start, end)
        out.slot_mapping += [decode_slots[s] for s in out.decodes]
        out.num_prefill_tokens = sum(end - start for start, end in spans)
        return out

    def _schedule_decodes(self, out: SchedulerOutput) -> dict:
        """Every running sequence decodes one token, oldest first; while one finds no free block, the most
        recently admitted group is preempted. Returns {decode: the slot of its new token}."""
        bm, slots, paged, running = self.block_manager, {}, self.policy == "paged", self.running
        roomy = not paged or bm.num_free_blocks >= len(running)  # a decode takes <= 1 block: none waits
        queue = deque(running)  # in admission order
        while queue:
            seq = queue.popleft()
            if seq.seq_id in self._stale:  # its cached KV may be overwritten: recompute it (and its group)
                self._preempt_group(seq, queue, out)
                continue
            if self.enable_chunked_prefill and seq.is_prefilling:  # blocks allocated at admission
                continue
            while not roomy and seq.status is SequenceStatus.RUNNING and not bm.can_append(seq.seq_id):
                victim = queue[-1] if queue else seq  # the most recently admitted one
                self._preempt_group(victim, queue, out)
            if seq.status is SequenceStatus.WAITING:
                continue
            slots[seq] = (  # its new (last) token's slot: taken now, or (static policies) reserved
                bm.append(seq.seq_id, 1)[0] if paged else bm.block_table(seq.seq_id).slot(seq.num_tokens - 1)
            )
            out.decodes.append(seq)
        self.running = [s for s in running if s.status is SequenceStatus.RUNNING]  # decodes + prefilling
        # preempted ones go back to the head of the queue, in admission order (groups stay together)
        for seq in sorted(out.preempted, key=running.index, reverse=True):
            self.waiting.appendleft(seq)
        return slots

    def plan_steps(self, out: SchedulerOutput, num_steps: int) -> None:
        """Multi-step: let the decode-only batch `out` run `num_steps` forwards on this one schedule, each
        decode taking now the slots of its tokens up to its max_tokens (a step past them gets slot -1: its
        row is computed and dropped, writing nothing); left at one step when the blocks are not free."""
        bm = self.block_manager
        more = {s: min(num_steps, s.max_tokens - len(s.output_token_ids)) - 1 for s in out.decodes}
        if self.policy == "paged":
            if sum(bm.block_table(s.seq_id).num_new_blocks(m) for s, m in more.items()) > bm.num_free_blocks:
                return
            rows = [bm.append(s.seq_id, m) if m else [] for s, m in more.items()]
        else:  # reserved at admission
            rows = [bm.slot_mapping(s.seq_id, s.num_tokens, s.num_tokens + m) for s, m in more.items()]
        out.num_steps = num_steps
        out.step_slots = [[row[j] if j < len(row) else -1 for row in rows] for j in range(num_steps - 1)]

    def _preempt_group(self, victim: Sequence, queue: deque, out: SchedulerOutput) -> None:
        """Preempt `victim` and its running siblings, whether still queued or already in out.decodes."""
        for seq in victim.group:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # finished, or not admitted
            if seq in queue:
                queue.remove(seq)
            if seq in out.decodes:
                out.decodes.remove(seq)
            self.block_manager.free(seq.seq_id)
            self._stale.discard(seq.seq_id)
            seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0
            seq.num_preemptions += 1
            self.num_preemptions += 1
            out.preempted.append(seq)

    def _schedule_admissions(self, out: SchedulerOutput) -> None:
        """Admit waiting requests (FCFS) while they fit, not after a preemption (it would thrash); chunked
        prefill: running prefills first, then admitted ones, a chunk each of the budget left."""
        bm, chunked = self.block_manager, self.enable_chunked_prefill
        budget = self.max_num_batched_tokens - len(out.decodes)
        if chunked:
            running_prefills = [s for s in self.running if s.is_prefilling]
            budget = schedule_chunks(running_prefills, budget, out)
        while self.waiting and not out.preempted:
            head = self.waiting[0]
            group = [s for s in head.group if s.status is SequenceStatus.WAITING]
            assert list(islice(self.waiting, len(group))) == group, "a group waits together"
            if len(self.running) + len(group) > self.max_num_seqs:
                break
            hits, shares, need, tokens = self._plan_admission(group)
            if (budget < 1) if chunked else (out.prefills and tokens > budget):
                break
            if bm.num_free_blocks - need < bm.watermark_blocks:
                break
            num_prefills, num_forked = len(out.prefills), len(out.forked)
            self._admit(group, hits, shares, out)
            if chunked:
                del out.prefills[num_prefills:], out.forked[num_forked:]  # the chunks decide what runs
                budget = schedule_chunks(group, budget, out)
            else:
                budget -= tokens

    def _plan_admission(self, group: list[Sequence]) -> tuple[list, list, int, int]:
        """(prefix-cache hits of the first sample, per other sample None (forks it) or how many of its
        blocks it shares, blocks needed, tokens to compute) if the waiting `group` were admitted now."""
        bm, bs, first = self.block_manager, self.block_size, group[0]
        if self.policy != "paged":  # static reservations: every sample reserves and computes its own
            need = sum(cdiv(self._reserve(s), bs) for s in group)
            return [], [0] * (len(group) - 1), need, sum(s.num_tokens for s in group)
        hits = bm.cached_prefix(first.token_ids, first.block_hashes)
        need = bm.blocks_needed(first.num_tokens, hits)
        tokens = first.num_tokens - len(hits) * bs
        shares = []
        for seq in group[1:]:
            if seq.token_ids == first.token_ids:
                shares.append(None)
                # it writes its first token into the shared last block, unless that one is full: a copy
                need += int(seq.num_tokens % bs != 0)
                continue
            common = next(
                (i for i, (a, b) in enumerate(zip(seq.token_ids, first.token_ids, strict=False)) if a != b),
                min(seq.num_tokens, first.num_tokens),
            )
            k = min(common, seq.num_tokens - 1) // bs  # whole blocks; its last token is always computed
            shares.append(k)
            need += cdiv(seq.num_tokens, bs) - k
            tokens += seq.num_tokens - k * bs
        return hits, shares, need, tokens

    def _admit(self, group: list[Sequence], hits: list, shares: list, out: SchedulerOutput) -> None:
        bm, bs, first = self.block_manager, self.block_size, group[0]
        self._admitted += [(s, s.snapshot()) for s in group]  # for `restore`: they change from here on
        bm.allocate(first.seq_id, self._admit_tokens(first), shared=hits)
        first.num_computed_tokens = len(hits) * bs
        out.prefills.append(first)
        if bm.prefix_cache is not None:
            out.num_lookup_tokens += first.num_tokens
            out.num_hit_tokens += len(hits) * bs
            out.num_lookup_blocks += cdiv(first.num_tokens, bs)
            out.num_hit_blocks += len(hits)
        blocks = bm.block_table(first.seq_id).block_ids
        # a sample that shares some of the first one's blocks waits for them (chunked prefill); one that
        # shares none (static policies reserve their own) computes its prompt alone
        parents = {id(seq): first for seq, k in zip(group[1:], shares, strict=True) if k != 0}
        for seq, k in zip(group[1:], shares, strict=True):
            if k is None:  # same tokens: share every block, sample from the first one's logits
                bm.fork(first.seq_id, seq.seq_id)
                seq.num_computed_tokens = first.num_computed_tokens
                out.forked.append((seq, first))
            else:
                bm.allocate(seq.seq_id, self._admit_tokens(seq), shared=blocks[:k])
                seq.num_computed_tokens = k * bs
                out.prefills.append(seq)
        for seq in group:
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.prefill_target, seq.prefill_parent = seq.num_tokens, parents.get(id(seq))
            self.running.append(seq)

    def mark_computed(self, seq: Sequence, end: int | None = None) -> None:
        """After a commit: `seq`'s tokens up to `end` (default: all) are computed; with prefix caching,
        the blocks this filled are named by their hash."""
        end = seq.num_tokens if end is None else end
        start, seq.num_computed_tokens = seq.num_computed_tokens, end
        bs = self.block_size
        if self.block_manager.prefix_cache is not None and end // bs > start // bs:  # a block filled
            self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.block_hashes, start, end)

    def usage(self, out: SchedulerOutput | None = None) -> dict:
        """KV memory (`BlockManager.usage`), during the forward of `out` if given (prompt slots no chunk
        has reached yet hold nothing)."""
        usage = self.block_manager.usage(sum(s.num_tokens for s in self.running))
        if out is not None and self.enable_chunked_prefill:
            usage["num_tokens"] -= unreached_slots(self.running, out)
        return usage


def schedule_chunks(seqs: list[Sequence], budget: int, out: SchedulerOutput) -> int:
    """Give each of `seqs` (prefilling, oldest first) its next chunk while `budget` lasts; returns what is
    left. A fork computes nothing; a sample sharing its parent's blocks runs once they are computed."""
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
    """Prompt slots of `running` that no chunk has reached by the end of step `out` (forks: none)."""
    return sum(
        s.prefill_target - out.chunk_ends.get(s.seq_id, s.num_computed_tokens)
        for s in running
        if s.is_prefilling
        and not (s.prefill_parent is not None and s.token_ids == s.prefill_parent.token_ids)
    )
