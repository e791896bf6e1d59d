"""Prompts in (InputProcessor), outputs out (OutputProcessor), what each step did (StepStats): notebook 06."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllmini.checks import as_token_ids
from vllmini.errors import InvalidArgumentError, InvalidTypeError
from vllmini.sampling import SamplingParams
from vllmini.sequence import Sequence, SequenceStatus


@dataclass
class Logprob:
    """The log-probability of one token and its rank among all (1 = most likely), as vLLM's."""

    logprob: float
    rank: int
    decoded_token: str | None = None  # its text, with a tokenizer


@dataclass
class CompletionOutput:
    """One of a request's n samples."""

    index: int
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    error: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per token: {token id: Logprob}, it and the top ones
    stop_reason: int | str | None = None  # the stop token id or string that ended it (None for EOS)


@dataclass
class RequestOutput:
    """A request's output: `outputs` holds all n samples (the flat fields are the first's)."""

    request_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "length", "stop", "abort" or "error" (see `error`)
    error: str | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True  # False while a streaming request runs
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
    logical_blocks: int = 0  # blocks the sequences would hold without sharing (used_blocks: physical)
    shared_blocks: int = 0  # physical blocks held by more than one sequence
    cached_blocks: int = 0  # free blocks that still hold a cached prefix
    num_copies: int = 0  # copy-on-write block copies made before this step's forward
    num_prefill_tokens: int = 0  # prompt tokens computed (not found cached or shared)
    num_lookup_tokens: int = 0  # prefix caching: tokens of the requests admitted in this step ...
    num_hit_tokens: int = 0  # ... found in the cache
    num_lookup_blocks: int = 0
    num_hit_blocks: int = 0

    @property
    def memory_saved(self) -> float:
        """1 - used / (used without sharing), as the PagedAttention paper measures it (Fig. 15)."""
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
    """What sharing saved over a run: memory, prefix-cache hit rates, prompt tokens, copies."""
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


STOP_WINDOW = 8  # tokens decoded beyond a stop string's length to look for it (tokens may decode to "")


class InputProcessor:
    """Checks a request's prompt and SamplingParams against the model (vocabulary, tokenizer)."""

    def __init__(self, tokenizer, vocab_size: int, chat_template: str | None = None):
        self.tokenizer, self.vocab_size, self.chat_template = tokenizer, vocab_size, chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of a chat ([{"role": ..., "content": ...}, ...]) as transformers renders it."""
        if self.chat_template is None:
            raise InvalidArgumentError(
                "this checkpoint has no chat template (chat_template.jinja or tokenizer_config.json's "
                "chat_template): write the prompt text yourself"
            )
        if not isinstance(messages, (list, tuple)) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        ):
            raise InvalidTypeError(
                f"messages must be a list of {{'role': str, 'content': str}}, got {messages!r}"
            )
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt
        )

    def check_params(self, params: SamplingParams | None) -> SamplingParams:
        """`params` (None: the defaults) if this model can honour them."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidTypeError(
                f"params must be a SamplingParams, got {type(params).__name__} {params!r}"
                + (": use SamplingParams(**params)" if isinstance(params, dict) else "")
            )
        if params.stop and self.tokenizer is None:
            raise InvalidArgumentError(
                f"SamplingParams(stop={params.stop!r}) needs a tokenizer to see the text (tokenizer.json "
                f"in the checkpoint); without one, stop on token ids: stop_token_ids=[...]"
            )
        self.token_ids(params.stop_token_ids, "stop_token_ids")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise InvalidArgumentError(
                f"logprobs must be <= the vocabulary size {self.vocab_size}, got {params.logprobs}"
            )
        return params

    def encode(self, prompt) -> list[int]:
        """Token ids of one prompt: a str (needs a tokenizer), or ids."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidTypeError(
                    "string prompts need a tokenizer (tokenizer.json in the checkpoint); pass token ids"
                )
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:  # (the tokenizer raises a bare TypeError)
                raise InvalidArgumentError(f"the prompt is not UTF-8 text: {e.reason} at {e.start}") from None
            prompt = self.tokenizer.encode(prompt).ids
        elif isinstance(prompt, (bytes, bytearray)):
            raise InvalidTypeError(
                f"a prompt must be a str or token ids, got bytes {prompt[:20]!r}: decode it first"
            )
        ids = self.token_ids(prompt, "prompt")
        if not ids:
            raise InvalidArgumentError("the prompt is empty: it needs at least one token")
        return ids

    def token_ids(self, ids, name: str) -> list[int]:
        """`ids` as a list of token ids of this model's vocabulary; `name` says whose they are."""
        ids = as_token_ids(ids, name)
        if bad := [t for t in ids if not 0 <= t < self.vocab_size]:
            raise InvalidArgumentError(f"{name} must be token ids in [0, {self.vocab_size}), got {bad[:5]}")
        return ids


class OutputProcessor:
    """Turns sequences into what the user sees (vLLM's OutputProcessor and Detokenizer)."""

    def __init__(self, tokenizer, eos_token_ids: set[int]):
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Why `seq` stops after `token` ("stop", "length"), or None; sets its stop_reason and text_end."""
        p = seq.sampling_params
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if p.stop:
            # a new stop string ends in the new token: decode the tail, the whole text only once found
            tail = self._text(seq.output_token_ids[-(max(map(len, p.stop)) + STOP_WINDOW) :])
            if any(x in tail for x in p.stop):
                text = self._text(seq.output_token_ids)
                found = [(i, x) for x in p.stop if (i := text.find(x)) >= 0]
                if found:  # (a tail decoded alone may differ from the whole text at its start)
                    seq.text_end, seq.stop_reason = min(found)
                    return "stop"
        if len(seq.output_token_ids) >= seq.max_tokens:
            return "length"
        return None

    def _text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def _token_text(self, token_id: int) -> str | None:
        return (
            None if self.tokenizer is None else self.tokenizer.decode([token_id], skip_special_tokens=False)
        )

    def completion(self, seq: Sequence) -> CompletionOutput:
        """One sample's output (or, "delta", what is new); text that may start a stop string is held back."""
        p, ids = seq.sampling_params, seq.output_token_ids
        text = None
        if self.tokenizer is not None:
            text = self._text(ids)[: seq.text_end]
            if seq.status is not SequenceStatus.FINISHED:
                hold = max(map(len, p.stop), default=1) - 1  # the start of a stop string
                text = text[: len(text) - hold].rstrip("\ufffd")  # and half a multi-byte character
        logprobs = None
        if p.logprobs is not None:
            logprobs = [
                {t: Logprob(lp, rank, self._token_text(t)) for t, (lp, rank) in e.items()}
                for e in seq.output_logprobs
            ]
        if p.output_kind == "delta":
            num_tokens, num_chars = seq.num_streamed
            seq.num_streamed = (len(ids), num_chars if text is None else len(text))
            ids = ids[num_tokens:]
            text = None if text is None else text[num_chars:]
            logprobs = None if logprobs is None else logprobs[num_tokens:]
        return CompletionOutput(
            seq.index, list(ids), text, seq.finish_reason, seq.error, logprobs, seq.stop_reason
        )

    def output(self, seq: Sequence) -> RequestOutput:
        """The RequestOutput of `seq`'s request, all its samples."""
        finished = all(s.status is SequenceStatus.FINISHED for s in seq.group)
        outputs = [self.completion(s) for s in sorted(seq.group, key=lambda s: s.index)]
        first = outputs[0]
        flat = (first.token_ids, first.text, first.finish_reason, first.error)
        return RequestOutput(
            seq.request_id, list(seq.prompt_token_ids), *flat, outputs, finished, first.logprobs
        )
