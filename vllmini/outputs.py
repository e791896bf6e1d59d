"""What the engine returns: a request's output (RequestOutput, with its n CompletionOutputs and their
Logprobs), and what each step did (StepStats), summed up over a run by sharing_summary."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token and its rank among all (1 = most likely), as vLLM's."""

    logprob: float
    rank: int
    decoded_token: str | None = None  # its text, with a tokenizer


@dataclass
class CompletionOutput:
    """One of a request's n samples (vLLM's name). finish_reason as RequestOutput's (None while it
    runs). logprobs (SamplingParams.logprobs): per token, {token id: Logprob} for the token drawn and
    the top alternatives. stop_reason: the stop token id or stop string that ended it (None for EOS)."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    error: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """A request's output. text is None without a tokenizer. finish_reason: "length", "stop", "abort"
    (abort_request), or "error" (its sampling failed; `error` says how). `outputs` holds all n samples
    (SamplingParams.n); the flat fields are those of the first, so n=1 code reads them directly.
    finished is False for what streaming requests (SamplingParams.output_kind) return while they run;
    with output_kind "delta" the tokens, text and logprobs are those new since the last output."""

    request_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str | None
    finish_reason: str | None
    error: str | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    logprobs: list[dict[int, Logprob]] | None = None


@dataclass
class StepStats:
    """What one engine step did, and the KV memory during its forward."""

    step: int
    num_prefills: int
    num_decodes: int
    num_waiting: int  # still queued after this step's admissions
    used_blocks: int
    free_blocks: int
    num_tokens: int  # slots holding a real token's K/V
    allocated_slots: int  # used_blocks * block_size (reserved, for static policies)
    pool_slots: int
    num_preemptions: int
    num_generated: int
    num_finished: int
    seconds: float  # forward + sampling (wall clock)
    # sharing pages: used_blocks are physical; without sharing the same sequences would hold
    # logical_blocks. cached_blocks: free blocks that still hold a cached prefix (part of free_blocks)
    logical_blocks: int = 0
    shared_blocks: int = 0  # physical blocks held by more than one sequence
    cached_blocks: int = 0
    num_copies: int = 0  # copy-on-write block copies made before this step's forward
    num_prefill_tokens: int = 0  # prompt tokens computed (not found cached or shared)
    num_lookup_tokens: int = 0  # prefix caching: tokens of the requests admitted in this step ...
    num_hit_tokens: int = 0  # ... found in the cache
    num_lookup_blocks: int = 0
    num_hit_blocks: int = 0

    @property
    def memory_saved(self) -> float:
        """Share of the KV blocks sharing saves: 1 - used / (used without sharing), as the
        PagedAttention paper measures it (Kwon et al., SOSP 2023, Fig. 15)."""
        return 1.0 - self.used_blocks / self.logical_blocks if self.logical_blocks else 0.0

    @property
    def batch_size(self) -> int:
        """Sequences in this step's forward (the running batch)."""
        return self.num_prefills + self.num_decodes

    @property
    def token_utilization(self) -> float:
        """Share of allocated slots that hold real tokens."""
        return self.num_tokens / self.allocated_slots if self.allocated_slots else 1.0

    @property
    def pool_utilization(self) -> float:
        """Share of the whole KV pool that holds real tokens."""
        return self.num_tokens / self.pool_slots


def sharing_summary(stats: list[StepStats]) -> dict:
    """What sharing saved over a run: memory saved (blocks in use with sharing vs without, summed over
    steps), prefix-cache hit rates (tokens and blocks), prompt tokens computed and found cached,
    copy-on-write copies, and the most blocks shared at once."""
    total = lambda name: sum(getattr(s, name) for s in stats)  # noqa: E731
    used, logical = total("used_blocks"), total("logical_blocks")
    lookup_t, lookup_b = total("num_lookup_tokens"), total("num_lookup_blocks")
    return {
        "memory_saved": 1.0 - used / logical if logical else 0.0,
        "token_hit_rate": total("num_hit_tokens") / lookup_t if lookup_t else 0.0,
        "block_hit_rate": total("num_hit_blocks") / lookup_b if lookup_b else 0.0,
        "prefill_tokens": total("num_prefill_tokens"),
        "cached_tokens": total("num_hit_tokens"),
        "copies": total("num_copies"),
        "max_shared_blocks": max((s.shared_blocks for s in stats), default=0),
    }
