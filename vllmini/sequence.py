"""A request's sequence as the scheduler sees it, and one step's batch (SchedulerOutput); notebook 06."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from operator import attrgetter

import torch

from vllmini.checks import as_int, as_seed
from vllmini.errors import InvalidArgumentError


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
        request_id=None,
        index: int = 0,
    ):
        if not prompt_token_ids:
            raise InvalidArgumentError("prompt_token_ids must hold at least one token, got an empty prompt")
        self.seq_id = seq_id
        self.request_id = seq_id if request_id is None else request_id  # samples of one request share it
        self.index = as_int(index, "index", min=0)  # which of the request's n samples
        self.group: list[Sequence] = [self]  # the request's samples, set by Scheduler.add
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache (a prefill computes the rest)
        self.prefill_target = 0  # chunked prefill: done when num_computed_tokens reaches it
        self.prefill_parent: Sequence | None = None  # the first sample, whose pages it waits for
        self.block_hashes: list[bytes] = []  # hash chain of its full blocks (prefix caching)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = as_int(max_tokens, "max_tokens", min=1)
        self.sampling_params = sampling_params  # the engine's SamplingParams; opaque here
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None  # "length" | "stop" | "abort" | "error" once finished
        self.error: str | None = None  # why, when finish_reason is "error"
        self.num_preemptions = 0
        self.output_logprobs: list = []  # one entry per output token, when logprobs are asked for
        self.stop_reason: int | str | None = None  # the stop token id or stop string that finished it
        self.text_end: int | None = None  # its text is cut here (before the stop string it produced)
        self.num_streamed: tuple[int, int] = (0, 0)  # (tokens, characters) already streamed
        # its own generator: its tokens do not depend on the batch, or on preemption
        self.generator = torch.Generator(device=device).manual_seed(as_seed(seed))

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """Admitted, but its prefill has not computed all its tokens yet (chunked prefill)."""
        return self.num_computed_tokens < self.prefill_target

    @property
    def max_len(self) -> int:
        """The most tokens it can ever hold: prompt + max_tokens."""
        return len(self.prompt_token_ids) + self.max_tokens

    # what a step may change of a sequence besides its lists, for `snapshot` and `restore`
    STEP_FIELDS = (
        "status num_preemptions num_computed_tokens finish_reason error stop_reason text_end num_streamed"
    ).split()
    _step_fields = attrgetter(*STEP_FIELDS)

    def snapshot(self) -> tuple:
        """What a step may change of this sequence, for `restore` (a failed step is undone)."""
        fields = self._step_fields(self)  # (one flat tuple: fewer objects for the garbage collector)
        return len(self.output_token_ids), len(self.output_logprobs), len(self.block_hashes), fields

    def restore(self, state: tuple) -> None:
        num_out, num_lp, num_hashes, values = state
        for name, value in zip(self.STEP_FIELDS, values, strict=True):
            setattr(self, name, value)
        del self.output_token_ids[num_out:], self.output_logprobs[num_lp:], self.block_hashes[num_hashes:]

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.value}, prompt={len(self.prompt_token_ids)},"
            f" output={len(self.output_token_ids)}/{self.max_tokens})"
        )


def as_group(seqs: Sequence | list[Sequence]) -> list[Sequence]:
    """A new request's sequences as a list: one `Sequence`, or the n samples of one prompt."""
    group = [seqs] if isinstance(seqs, Sequence) else list(seqs)
    if not group or not all(isinstance(s, Sequence) for s in group):
        raise InvalidArgumentError(f"add() takes a Sequence or a non-empty list of them, got {seqs!r}")
    for seq in group:
        if seq.status is not SequenceStatus.WAITING or seq.output_token_ids:
            raise InvalidArgumentError(f"only a new sequence can be added, got {seq}")
    first = group[0]
    if len({s.seq_id for s in group}) < len(group) or any(
        s.request_id != first.request_id or s.prompt_token_ids != first.prompt_token_ids for s in group
    ):
        raise InvalidArgumentError(
            "the samples of one request need distinct seq_ids, one request_id and one prompt, got "
            f"{[(s.seq_id, s.request_id) for s in group]}"
        )
    return group


@dataclass
class SchedulerOutput:
    """One step's batch: prefills first, then decodes; the new tokens' slots in the same order."""

    prefills: list[Sequence] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting in this step
    slot_mapping: list[int] = field(default_factory=list)
    forked: list[tuple[Sequence, Sequence]] = field(default_factory=list)  # (child, parent): same logits
    num_lookup_tokens: int = 0  # prefix caching: tokens of the sequences admitted with a lookup
    num_hit_tokens: int = 0  # ... of them found in the cache (not computed)
    num_lookup_blocks: int = 0
    num_hit_blocks: int = 0
    num_prefill_tokens: int = 0  # prompt tokens computed in this step (not found cached or shared)
    chunk_ends: dict = field(default_factory=dict)  # chunked prefill: seq_id -> end of its chunk
    num_steps: int = 1  # multi-step: forwards of this decode-only batch (Scheduler.plan_steps)
    step_slots: list = field(default_factory=list)  # ... and the slots of steps 2.. (a list per step)
    # the counts StepStats copies, under the same names
    COUNTS = "num_prefill_tokens num_lookup_tokens num_hit_tokens num_lookup_blocks num_hit_blocks".split()

    def prefill_end(self, seq: Sequence) -> int:
        """Where this step's prefill of `seq` stops: num_tokens, or earlier for a chunk."""
        return self.chunk_ends.get(seq.seq_id, seq.num_tokens)

    @property
    def partial_prefills(self) -> list[Sequence]:
        """Prefills whose chunk stops before their last token: they sample nothing."""
        return [s for s in self.prefills if self.prefill_end(s) < s.num_tokens]

    @property
    def spans(self) -> list[tuple[int, int]]:
        """The tokens [start, end) each of `seqs` computes (a decode: its last one)."""
        prefills = [(s.num_computed_tokens, self.prefill_end(s)) for s in self.prefills]
        return prefills + [(s.num_tokens - 1, s.num_tokens) for s in self.decodes]

    @property
    def seqs(self) -> list[Sequence]:
        """The sequences in the forward, one logits row each."""
        return self.prefills + self.decodes

    @property
    def samplers(self) -> list[tuple[Sequence, int]]:
        """Every sequence that gets a token this step, with its logits row (forked ones share a row)."""
        n, partial = len(self.prefills), {id(s) for s in self.partial_prefills}  # (every decode samples)
        own = [(s, i) for i, s in enumerate(self.seqs) if i >= n or id(s) not in partial]
        rows = {id(s): i for i, s in enumerate(self.prefills)}  # a fork's parent is a prefill
        return own + [(c, rows[id(p)]) for c, p in self.forked]

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes
