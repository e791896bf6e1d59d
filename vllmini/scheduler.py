"""Continuous batching: which sequences run in the next forward, and where their tokens go.

Every step the scheduler builds one batch: all running sequences take one decode step each, and
waiting prompts are admitted (prefilled) while the block pool has room, keeping a small watermark of
free blocks so the running ones can still grow. A decode that needs a new block when none is free
preempts the most recently admitted sequence *by recomputation*: its blocks are freed and it goes back
to the head of the waiting queue with the tokens it has generated; when it is admitted again, its
prompt + generated tokens are prefilled in one go. Requests are never lost or duplicated.

A step can be undone: `snapshot()` before `schedule()` and `restore()` after a failed forward put back
every allocation, append and preemption, so the next `schedule()` makes the same batch again. A sequence
preempted in the failed step gets its blocks back, but the failed forward may have written other tokens
into them: it is marked stale and recomputed unless the replayed step preempts it again anyway.

Policies, over the same model and pool:
  "paged"   blocks are allocated as tokens arrive (vLLM).
  "static"  each admitted request reserves max_model_len slots up front (before paging; Orca (Max)).
  "oracle"  each request reserves exactly prompt + max_tokens slots (Orca (Oracle): knows its length).
Static reservations are taken as whole blocks from the same pool, so the comparison keeps everything
else equal; a reservation can never run out, so static policies never preempt.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field

import torch

from vllmini.block_table import BlockManager
from vllmini.checks import as_float, as_int, cdiv, one_of
from vllmini.errors import EngineStateError, InvalidArgumentError
from vllmini.model import AttentionMetadata

POLICIES = ("paged", "static", "oracle")


def check_policy(policy) -> str:
    """`policy` if it is one of POLICIES (the one place policies are checked)."""
    return one_of(policy, "policy", POLICIES)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request's state: its tokens, where it is in the queue, and its own random generator."""

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        seed: int,
        device: str | torch.device = "cpu",
        sampling_params=None,
    ):
        if not prompt_token_ids:
            raise InvalidArgumentError("prompt_token_ids must hold at least one token, got an empty prompt")
        self.seq_id = seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = as_int(max_tokens, "max_tokens", min=1)
        self.sampling_params = sampling_params  # the engine's SamplingParams; opaque here
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "length" | "stop" | "abort" | "error" once finished
        self.num_preemptions = 0
        # its own generator: its samples do not depend on what else is in the batch, or on preemption
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_len(self) -> int:
        """The most tokens it can ever hold: prompt + max_tokens."""
        return len(self.prompt_token_ids) + self.max_tokens

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.value}, prompt={len(self.prompt_token_ids)},"
            f" output={len(self.output_token_ids)}/{self.max_tokens})"
        )


@dataclass
class SchedulerOutput:
    """One step's batch: prefills first, then decodes; the new tokens' slots in the same order."""

    prefills: list[Sequence] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting in this step
    slot_mapping: list[int] = field(default_factory=list)

    @property
    def seqs(self) -> list[Sequence]:
        return self.prefills + self.decodes

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """Queues of waiting and running sequences over one `BlockManager`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        *,
        policy: str = "paged",
        watermark: float = 0.01,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
    ):
        check_policy(policy)
        num_blocks = as_int(num_blocks, "num_blocks", min=1)
        block_size = as_int(block_size, "block_size", min=1)
        max_model_len = as_int(max_model_len, "max_model_len", min=1)
        max_num_seqs = as_int(max_num_seqs, "max_num_seqs", min=1)
        watermark = as_float(watermark, "watermark", min=0.0)
        if not watermark < 1.0:
            raise InvalidArgumentError(f"watermark must be a fraction of the pool in [0, 1), got {watermark}")
        if max_num_batched_tokens is not None:
            max_num_batched_tokens = as_int(max_num_batched_tokens, "max_num_batched_tokens", min=1)
        # reservations never grow, so static policies need no headroom
        watermark_blocks = int(watermark * num_blocks) if policy == "paged" else 0
        self.block_manager = BlockManager(num_blocks, block_size, watermark_blocks)
        if policy == "static" and cdiv(max_model_len, block_size) > num_blocks:
            raise InvalidArgumentError(
                f"policy 'static' reserves max_model_len={max_model_len} slots per request, but "
                f"the pool has only {num_blocks} blocks x {block_size} = {num_blocks * block_size}"
            )
        self.policy, self.block_size, self.max_model_len = policy, block_size, max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or max(max_model_len, 2048)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0
        self._live: dict = {}  # seq_id -> Sequence, waiting or running
        self._stale: set = set()  # seq_ids whose cached KV a failed forward may have overwritten

    # -------------------------------------------------------------------------
    # requests in and out

    def check_fits(self, seq: Sequence) -> None:
        """InvalidArgumentError (a ValueError) if `seq` could never run, even alone with the whole pool."""
        if seq.max_len > self.max_model_len:
            raise InvalidArgumentError(
                f"prompt ({len(seq.prompt_token_ids)} tokens) + max_tokens ({seq.max_tokens}) = "
                f"{seq.max_len} exceeds max_model_len={self.max_model_len}"
            )
        bm = self.block_manager
        usable = bm.num_blocks - bm.watermark_blocks
        # the last sampled token is never written to the cache: it holds at most max_len - 1 tokens
        need = cdiv(self._reserve(seq) if self.policy != "paged" else seq.max_len - 1, self.block_size)
        if need > usable:
            raise InvalidArgumentError(
                f"request needs {need} blocks of {self.block_size} tokens, but the pool has "
                f"{bm.num_blocks} blocks ({bm.watermark_blocks} held back as watermark): "
                f"it could never fit"
            )

    def add(self, seq: Sequence) -> None:
        """Queue a new request at the back. A seq_id already waiting or running is refused, as is a
        sequence that already ran."""
        if seq.seq_id in self._live:
            raise InvalidArgumentError(
                f"seq_id {seq.seq_id!r} is already queued or running: {self._live[seq.seq_id]}"
            )
        if seq.status is not SequenceStatus.WAITING or seq.output_token_ids:
            raise InvalidArgumentError(f"only a new sequence can be added, got {seq}")
        self.check_fits(seq)
        self.waiting.append(seq)
        self._live[seq.seq_id] = seq

    def finish(self, seq: Sequence, reason: str) -> None:
        """A running sequence is done: free its blocks."""
        if seq.status is not SequenceStatus.RUNNING or self._live.get(seq.seq_id) is not seq:
            raise EngineStateError(f"only running sequences can finish, got {seq}")
        self.running.remove(seq)
        self.block_manager.free(seq.seq_id)
        self._retire(seq, reason)

    def abort(self, seq_id) -> Sequence | None:
        """Stop a waiting or running sequence (between steps) and free its blocks; None if unknown."""
        seq = self._live.get(seq_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq_id)
        else:
            self.waiting.remove(seq)
        self._retire(seq, "abort")
        return seq

    def _retire(self, seq: Sequence, reason: str) -> None:
        del self._live[seq.seq_id]
        self._stale.discard(seq.seq_id)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -------------------------------------------------------------------------
    # undoing a step

    def snapshot(self) -> tuple:
        """Everything `schedule()` changes: queues, statuses, preemption counts and the block manager."""
        seqs = [*self.waiting, *self.running]
        return (
            list(self.waiting),
            list(self.running),
            [(s, s.status, s.num_preemptions) for s in seqs],
            self.num_preemptions,
            self.block_manager.snapshot(),
        )

    def restore(self, snapshot: tuple, stale=()) -> None:
        """Undo everything since `snapshot()`. `stale`: sequences whose blocks a failed forward may have
        written into (those preempted in that step); they are recomputed unless preempted again."""
        waiting, running, seqs, num_preemptions, blocks = snapshot
        self.waiting, self.running = deque(waiting), list(running)
        for seq, status, n in seqs:
            seq.status, seq.num_preemptions = status, n
        self.num_preemptions = num_preemptions
        self.block_manager.restore(blocks)
        self._stale.update(s.seq_id for s in stale if s.status is SequenceStatus.RUNNING)

    # -------------------------------------------------------------------------
    # one step

    def _reserve(self, seq: Sequence) -> int:
        """Slots a static policy reserves for `seq` at admission."""
        return self.max_model_len if self.policy == "static" else seq.max_len

    def _admit_tokens(self, seq: Sequence) -> int:
        """Slots `seq` takes when admitted: its tokens (paged), or its reservation (static policies)."""
        return seq.num_tokens if self.policy == "paged" else self._reserve(seq)

    def stall_message(self) -> str:
        """Why nothing can be scheduled although requests wait (for the engine's no-progress error)."""
        bm, head = self.block_manager, self.waiting[0]
        need = cdiv(self._admit_tokens(head), self.block_size)
        return (
            f"request {head.seq_id} ({head.num_tokens} tokens, {need} blocks) cannot be scheduled with "
            f"nothing running: {bm.num_free_blocks} of {bm.num_blocks} blocks free, {bm.watermark_blocks} "
            f"held back as watermark"
        )

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.free(seq.seq_id)
        self._stale.discard(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch, allocating or reserving the slots its new tokens go to."""
        out = SchedulerOutput()
        bm = self.block_manager
        # 1) every running sequence decodes one token (the one it sampled last step), oldest first
        queue, kept = list(self.running), []
        while queue:
            seq = queue.pop(0)
            if seq.seq_id in self._stale:  # its cached KV may be overwritten: recompute it
                self._preempt(seq, out)
                continue
            if self.policy == "paged":
                while bm.block_table(seq.seq_id).num_new_blocks(1) > bm.num_free_blocks:
                    victim = queue.pop() if queue else seq  # the most recently admitted one
                    self._preempt(victim, out)
                    if victim is seq:
                        break
                if seq.status is SequenceStatus.WAITING:
                    break
                bm.append(seq.seq_id, 1)
            kept.append(seq)
            out.decodes.append(seq)
        self.running = kept
        # preempted ones go back to the head of the queue, the oldest first
        for seq in out.preempted:
            self.waiting.appendleft(seq)

        # 2) admit waiting sequences (FCFS) while they fit; not after a preemption (it would thrash)
        budget = self.max_num_batched_tokens - len(out.decodes)
        while self.waiting and not out.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_tokens  # prompt + whatever it generated before a preemption
            if out.prefills and n > budget:
                break
            if not bm.can_allocate(self._admit_tokens(seq)):
                break
            bm.allocate(seq.seq_id, self._admit_tokens(seq))
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.prefills.append(seq)
            budget -= n

        # 3) the slots of this step's new tokens: whole prompt for prefills, the last token for decodes
        for seq in out.prefills:
            out.slot_mapping += bm.slot_mapping(seq.seq_id, 0, seq.num_tokens)
        for seq in out.decodes:
            out.slot_mapping += bm.slot_mapping(seq.seq_id, seq.num_tokens - 1, seq.num_tokens)
        return out

    def build_inputs(
        self, out: SchedulerOutput, device=None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input_ids (num_tokens,), positions (num_tokens,) and the AttentionMetadata of a batch."""
        ids, pos, query_lens, seq_lens = [], [], [], []
        for seq in out.prefills:
            ids += seq.token_ids
            pos += range(seq.num_tokens)
            query_lens.append(seq.num_tokens)
            seq_lens.append(seq.num_tokens)
        for seq in out.decodes:
            ids.append(seq.token_ids[-1])
            pos.append(seq.num_tokens - 1)
            query_lens.append(1)
            seq_lens.append(seq.num_tokens)
        seqs = out.seqs
        block_tables, _ = self.block_manager.build_block_tables([s.seq_id for s in seqs])
        # static reservations hold more blocks than the tokens fill: read only the blocks in use
        block_tables = block_tables[:, : cdiv(max(seq_lens, default=1), self.block_size)]
        meta = AttentionMetadata.build(
            query_lens, block_tables, seq_lens, out.slot_mapping, len(out.prefills), device=device
        )
        return (
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(pos, dtype=torch.int64, device=device),
            meta,
        )

    def usage(self) -> dict:
        """KV memory right now: slots holding real tokens vs allocated (reserved) vs in the pool.

        O(sequences), for every step: BlockManager.utilization walks every block (it counts shared blocks
        once; 7 ms a step at 16k blocks), and counts a static reservation as tokens."""
        bm = self.block_manager
        # a running sequence holds num_tokens - 1 tokens between steps, num_tokens during its forward
        num_tokens = sum(s.num_tokens for s in self.running)
        used = bm.num_blocks - bm.num_free_blocks
        return {
            "num_tokens": num_tokens,
            "allocated_slots": used * self.block_size,
            "pool_slots": bm.num_blocks * self.block_size,
            "used_blocks": used,
            "free_blocks": bm.num_free_blocks,
        }
