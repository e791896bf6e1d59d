"""The engine (notebook 06): requests in, tokens out, many requests sharing one paged KV cache.

    engine = LLMEngine.from_pretrained("path/to/llama", num_blocks=512)
    outputs = engine.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))

Each `step()` schedules a batch, runs ONE forward over it, samples one token per sequence from its own
seeded generator, and retires the finished. A step is all-or-nothing, its commit included: an exception
anywhere in it (or Ctrl-C before the commit; during the commit Ctrl-C waits) rolls it back (allocations,
preemptions, generators, tokens), so the outputs equal an uninterrupted run. `stats` keeps the last
STATS_WINDOW steps or more.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from vllmini import models
from vllmini.attention import BACKENDS
from vllmini.checks import as_block_size, as_bool, as_fraction, as_int, one_of
from vllmini.errors import EngineStateError, InvalidArgumentError, InvalidTypeError
from vllmini.model import LlamaModel
from vllmini.model_runner import ModelRunner
from vllmini.outputs import InputProcessor, OutputProcessor, RequestOutput, StepStats
from vllmini.sampling import SamplingParams, not_finite, sample_batch, sample_seed, token_logprobs
from vllmini.scheduler import Scheduler, check_policy
from vllmini.sequence import SchedulerOutput, Sequence, SequenceStatus

STATS_WINDOW = 1024  # engine.stats holds the last 1,024 steps or more (at most 2,048): memory stays bounded


@dataclass
class EngineConfig:
    """Every engine option, checked once, in one place (as nano-vllm's `Config`)."""

    block_size: int = 16  # tokens per KV block
    # the KV pool's size, at most one of these three; none: 0.9 of free GPU memory, or on a CPU room for 8
    # sequences of max_model_len (at most 1 GiB)
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None  # the longest prompt + output; None = max_position_embeddings
    backend: str = "auto"  # decode attention: "auto", "torch", "cupy" or "emulator" (vllmini.attention)
    policy: str = "paged"  # "paged", "static" or "oracle" (vllmini.scheduler)
    watermark: float = 0.01  # share of the pool new requests must leave free, so running ones can grow
    max_num_seqs: int = 256  # the most sequences in one batch (a request with n samples counts n)
    # the most tokens in one forward; None = max(max_model_len, 2048); >= max_model_len without chunking
    max_num_batched_tokens: int | None = None
    seed: int = 0  # derives the seed of every request that has none
    # reuse cached KV blocks of a prompt prefix (policy "paged"); off: 2-4% tokens/s on an H200 unshared
    enable_prefix_caching: bool = False
    # split prompts into chunks so no step exceeds max_num_batched_tokens (Sarathi, 2023); on: it cost no
    # throughput on an H200 (benchmarks/RESULTS.md)
    enable_chunked_prefill: bool = True
    # replay decode-only steps from CUDA graphs (vllmini.model_runner). None: on for a CUDA model with
    # backend "cupy" or "torch", off on the CPU (where True raises)
    use_cuda_graphs: bool | None = None
    max_cuda_graph_batch_size: int = 256  # the largest decode batch replayed from a graph (at most 512)
    # multi-step (vLLM's num_scheduler_steps): a decode-only batch of greedy requests with nothing waiting
    # runs up to this many forwards per schedule, the host's work once for all (1: off)
    num_scheduler_steps: int = 1

    def __post_init__(self):
        self.block_size = as_block_size(self.block_size)
        for name in ("num_blocks", "kv_cache_memory", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                setattr(self, name, as_int(getattr(self, name), name, min=1))
        if self.gpu_memory_utilization is not None:
            self.gpu_memory_utilization = as_fraction(
                self.gpu_memory_utilization, "gpu_memory_utilization", "(0, 1]"
            )
        sizing = ("num_blocks", "kv_cache_memory", "gpu_memory_utilization")
        sizes = [name for name in sizing if getattr(self, name) is not None]
        if len(sizes) > 1:
            raise InvalidArgumentError(
                f"num_blocks, kv_cache_memory and gpu_memory_utilization each size the KV cache: give "
                f"exactly one of them (or none for the default), got {sizes}"
            )
        one_of(self.backend, "backend", BACKENDS)
        self.watermark = as_fraction(self.watermark, "watermark", "[0, 1)")
        self.max_num_seqs = as_int(self.max_num_seqs, "max_num_seqs", min=1)
        self.seed = as_int(self.seed, "seed")
        self.enable_prefix_caching = as_bool(self.enable_prefix_caching, "enable_prefix_caching")
        check_policy(self.policy, self.enable_prefix_caching)
        self.enable_chunked_prefill = as_bool(self.enable_chunked_prefill, "enable_chunked_prefill")
        if self.use_cuda_graphs is not None:
            self.use_cuda_graphs = as_bool(self.use_cuda_graphs, "use_cuda_graphs")
        self.max_cuda_graph_batch_size = as_int(
            self.max_cuda_graph_batch_size, "max_cuda_graph_batch_size", min=1, max=512
        )
        self.num_scheduler_steps = as_int(self.num_scheduler_steps, "num_scheduler_steps", min=1, max=64)
        if self.max_model_len is not None:
            self.check_batched_tokens(self.max_model_len)

    def check_batched_tokens(self, max_model_len: int) -> None:
        """Without chunked prefill, max_num_batched_tokens must hold a whole prompt of max_model_len."""
        batched = self.max_num_batched_tokens
        if not self.enable_chunked_prefill and batched is not None and batched < max_model_len:
            raise InvalidArgumentError(
                f"max_num_batched_tokens={batched} is smaller than max_model_len={max_model_len}: a "
                f"whole prompt must fit in one forward (or set enable_chunked_prefill=True)"
            )


def make_config(config: EngineConfig | None, kwargs: dict) -> EngineConfig:
    """`config` (default EngineConfig()) with `kwargs` replacing its fields; checked."""
    config = EngineConfig() if config is None else config
    if not isinstance(config, EngineConfig):
        raise InvalidTypeError(f"config must be an EngineConfig or None, got {type(config).__name__}")
    names = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise InvalidTypeError(f"unknown engine option(s) {unknown}; EngineConfig has {sorted(names)}")
    return replace(config, **kwargs)  # runs __post_init__: every field checked again


class DeferSigint:
    """Within `with`: Ctrl-C raises KeyboardInterrupt until `hold()`, then is only recorded in `.interrupted`
    (a step's commit must not stop half-way)."""

    def __init__(self, hold: bool = False):
        self.holding, self.interrupted, self._previous = hold, False, None

    def hold(self) -> None:
        self.holding = True

    def _handler(self, signum, frame):
        if self.holding:
            self.interrupted = True
        elif self._previous is not signal.SIG_IGN:
            self.holding = True  # a second Ctrl-C must not interrupt the rollback of the first
            if callable(self._previous):
                self._previous(signum, frame)  # Python's default handler raises KeyboardInterrupt
            else:
                raise KeyboardInterrupt

    def __enter__(self) -> DeferSigint:
        if threading.current_thread() is threading.main_thread():  # only it receives signals
            previous = signal.signal(signal.SIGINT, self._handler)
            self._previous = signal.SIG_DFL if previous is None else previous  # None: set outside Python
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class LLMEngine:
    """Continuous batching over a paged KV cache. Options: EngineConfig's fields, as a config, keyword
    arguments, or both (keywords win)."""

    def __init__(self, model, config: EngineConfig | None = None, **kwargs):
        config = make_config(config, kwargs)
        if not isinstance(model, LlamaModel):
            model = LlamaModel.from_pretrained(model)  # e.g. a transformers LlamaForCausalLM
        max_pos = model.config.max_position_embeddings
        max_model_len = max_pos if config.max_model_len is None else config.max_model_len
        if max_model_len > max_pos:
            raise InvalidArgumentError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={max_pos}"
            )
        if config.block_size > max_model_len:  # before the KV cache: such blocks are never filled
            raise InvalidArgumentError(
                f"block_size={config.block_size} exceeds max_model_len={max_model_len}: no sequence fills one"
            )
        config.check_batched_tokens(max_model_len)
        config = replace(config, max_model_len=max_model_len)
        self.model, self.policy, self.max_model_len = model, config.policy, max_model_len
        self.device, self.seed = model.device, config.seed
        self.runner = runner = ModelRunner(model, config)
        self.kv_cache, self.backend, self.graphs = runner.kv_cache, runner.backend, runner.graphs
        self.scheduler = Scheduler(config, runner.kv_cache.num_blocks)
        # the options as run: max_num_batched_tokens as the scheduler resolved it
        batched = self.scheduler.max_num_batched_tokens
        self.config = self.runner.config = replace(config, max_num_batched_tokens=batched)
        self.tokenizer = model.tokenizer
        self.inputs = InputProcessor(self.tokenizer, model.config.vocab_size, model.chat_template)
        self.outputs = OutputProcessor(self.tokenizer, set(model.eos_token_ids))
        self.stats: list[StepStats] = []
        self.num_forwards = 0  # forwards of committed steps (one per step)
        self._next_id = 0
        self._ready: list[RequestOutput] = []  # finished (or streamed) but not yet returned by step()

    @property
    def eos_token_ids(self) -> set[int]:
        """Token ids that end a request ("stop") unless SamplingParams.ignore_eos; settable."""
        return self.outputs.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        ids = list(ids) if isinstance(ids, (set, frozenset)) else ids  # (the getter gives a set)
        self.outputs.eos_token_ids = set(self.inputs.token_ids(ids, "eos_token_ids"))

    @classmethod
    def from_pretrained(
        cls,
        path_or_model,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        config: EngineConfig | None = None,
        **engine_kwargs,
    ) -> LLMEngine:
        """Load a Llama checkpoint directory (or transformers model, or a name vllmini.models knows, e.g.
        "SmolLM2-135M-Instruct": fetched the first time) and build an engine on it."""
        config = make_config(config, engine_kwargs)  # bad options fail before the weights load
        path_or_model = models.resolve(path_or_model)
        return cls(LlamaModel.from_pretrained(path_or_model, dtype=dtype, device=device), config)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """A chat ([{"role": "user", "content": "..."}, ...]) as prompt text, in the model's chat template."""
        return self.inputs.apply_chat_template(messages, add_generation_prompt)

    def _new_request(self, prompt, params: SamplingParams | None, rid: int) -> list[Sequence]:
        """A checked, tokenized request (its n samples) that fits; nothing is queued yet."""
        params = self.inputs.check_params(params)
        ids = self.inputs.encode(prompt)
        # no seed: derived from the engine's seed and the request number (hashed: unrelated streams)
        seed = params.seed if params.seed is not None else random.Random(f"{self.seed}:{rid}").getrandbits(63)
        seqs = [
            Sequence(
                rid if params.n == 1 else (rid, i),
                ids,
                params.max_tokens,
                seed=sample_seed(seed, i),
                device=self.device,
                sampling_params=params,
                request_id=rid,
                index=i,
            )
            for i in range(params.n)
        ]
        self.scheduler.check_fits(seqs)
        return seqs

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. InvalidArgumentError if it could never run."""
        seqs = self._new_request(prompt, params, self._next_id)
        self.scheduler.add(seqs)
        self._next_id += 1
        return seqs[0].request_id

    def abort_request(self, request_id: int) -> bool:
        """Stop an unfinished request (its output comes from the next `step()`, finish_reason "abort");
        False if none has this id."""
        seq = self.scheduler.abort(as_int(request_id, "request_id"))
        if seq is not None:
            self._ready.append(self.outputs.output(seq))
        return seq is not None

    def has_unfinished_requests(self) -> bool:
        """Requests still queued or running, or finished ones that `step()` has not returned yet."""
        return self.scheduler.has_unfinished() or bool(self._ready)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def step(self) -> list[RequestOutput]:
        """One forward over the whole batch; returns finished (or aborted) requests, and streaming ones'
        output so far (finished=False). All-or-nothing: see the module docstring."""
        t0, sched = time.perf_counter(), self.scheduler
        with DeferSigint() as sigint:
            snapshot, before, out, saved = sched.snapshot(), sched.num_preemptions, None, []
            num_ready = len(self._ready)
            try:
                out = sched.schedule()
                if (steps := self._num_steps(out)) > 1:
                    sched.plan_steps(out, steps)
                usage = sched.usage(out)  # the KV memory during this step's forward
                if out.is_empty and sched.has_unfinished():
                    raise self._no_progress_error()
                copies = sched.block_manager.take_pending_copies()  # copy-on-write (src, dst) blocks
                self.runner.copy_blocks(copies)
                sampled = self._forward_and_sample(out, saved) if not out.is_empty else ([], [[]], [])
                sigint.hold()
                if not out.is_empty:  # a failure in the commit is undone too
                    self._commit(out, sampled, usage, sched.num_preemptions - before, len(copies), t0)
            except BaseException:
                sigint.hold()
                sched.restore(snapshot, stale=out.preempted if out is not None else ())
                for seq, state in saved:
                    seq.generator.set_state(state)
                del self._ready[num_ready:]
                raise
        if sigint.interrupted:  # Ctrl-C during the commit: the results wait for the next step()
            raise KeyboardInterrupt
        ready, self._ready = self._ready, []
        return ready

    def _no_progress_error(self) -> EngineStateError:
        """The head of the queue cannot be admitted although nothing runs: say which, and what it needs."""
        assert self.scheduler.waiting and not self.scheduler.running, "running sequences always schedule"
        head = self.scheduler.waiting[0].request_id
        return EngineStateError(
            f"no progress: {self.scheduler.stall_message()}; abort_request({head}) removes it"
        )

    def _num_steps(self, out: SchedulerOutput) -> int:
        """Forwards `out` may run on one schedule: num_scheduler_steps for a decode-only batch of greedy
        requests without logprobs while none waits or is mid-prefill (at most the tokens the longest may
        still take), else 1."""
        sched, most = self.scheduler, self.config.num_scheduler_steps
        busy = out.prefills or out.preempted or sched.waiting or len(out.decodes) < len(sched.running)
        if most == 1 or busy or not out.decodes:
            return 1
        params = [s.sampling_params for s in out.decodes]
        if any(not p.is_greedy or p.logprobs is not None for p in params):
            return 1
        return min(most, max(s.max_tokens - len(s.output_token_ids) for s in out.decodes))

    @torch.inference_mode()
    def _forward_and_sample(self, out, saved: list) -> tuple[list, list, list]:
        """The forward, then (out.samplers, a list per forward of their tokens or exceptions, logprobs or
        None); saves (sequence, generator state) of the sampled ones in `saved` first."""
        if out.num_steps > 1:  # multi-step: greedy, each step's tokens from the device's argmax
            tokens, bad = self.runner.execute_steps(out, self.scheduler.block_manager)
            steps = [
                [not_finite(i) if b else t for i, (t, b) in enumerate(zip(ts, bs, strict=True))]
                for ts, bs in zip(tokens, bad, strict=True)
            ]
            return out.samplers, steps, [None] * len(out.decodes)
        logits = self.runner.execute(out, self.scheduler.block_manager)  # (S, V)
        samplers = out.samplers  # forked samples draw from their parent's row
        if not samplers:  # only chunks of prompts ran
            return [], [[]], []
        seqs, rows = [s for s, _ in samplers], [i for _, i in samplers]
        params = [s.sampling_params for s in seqs]
        saved += [(s, s.generator.get_state()) for s, p in zip(seqs, params, strict=True) if not p.is_greedy]
        tokens = sample_batch(logits, rows, params, [s.generator for s in seqs])
        logprobs: list = [None] * len(seqs)
        want = [j for j, p in enumerate(params) if p.logprobs is not None and isinstance(tokens[j], int)]
        if want:
            num_logprobs = [params[j].logprobs for j in want]
            entries = token_logprobs(logits, [rows[j] for j in want], [tokens[j] for j in want], num_logprobs)
            for j, entry in zip(want, entries, strict=True):
                logprobs[j] = entry
        return samplers, [tokens], logprobs

    def _commit(self, out, sampled: tuple, usage: dict, num_preemptions: int, copies: int, t0: float) -> None:
        """Append each sequence's token (multi-step: each forward's in turn) and retire the finished ones
        (Ctrl-C is held meanwhile); a StepStats per forward."""
        sched = self.scheduler
        samplers, steps, logprobs = sampled
        for seq in out.partial_prefills:  # a chunk of its prompt: computed, nothing to sample yet
            sched.mark_computed(seq, out.prefill_end(seq))
        streamed, records = {}, []  # request_id -> a streaming request's sample that got a token; StepStats
        seconds, counts = (time.perf_counter() - t0) / len(steps), [getattr(out, n) for n in out.COUNTS]
        for j, tokens in enumerate(steps):
            generated = finished = 0
            for (seq, _), token, lp in zip(samplers, tokens, logprobs, strict=True):
                if seq.status is SequenceStatus.FINISHED:  # multi-step: at an earlier forward of this step
                    continue
                sched.mark_computed(seq)  # its K/V are in the cache now (and findable, with prefix caching)
                if seq.sampling_params.output_kind != "final_only":
                    streamed.setdefault(seq.request_id, seq)
                if isinstance(token, Exception):
                    reason, seq.error = "error", f"sampling failed: {type(token).__name__}: {token}"
                else:
                    seq.output_token_ids.append(token)
                    generated += 1
                    if lp is not None:
                        seq.output_logprobs.append(lp)
                    reason = self.outputs.finish_reason(seq, token)
                if reason is None:
                    continue
                sched.finish(seq, reason)
                finished += 1
                if all(s.status is SequenceStatus.FINISHED for s in seq.group):
                    self._ready.append(self.outputs.output(seq))
            first = j == 0  # a multi-step's later forwards: decodes only, each row one token further
            records.append(
                StepStats(
                    step=self.num_forwards + j,
                    num_prefills=len(out.prefills),
                    num_decodes=len(out.decodes),
                    num_waiting=len(sched.waiting),
                    num_preemptions=num_preemptions * first,
                    num_generated=generated,
                    num_finished=finished,
                    seconds=seconds,
                    num_copies=copies * first,
                    **{name: n * first for name, n in zip(out.COUNTS, counts, strict=True)},  # prefill, cache
                    **dict(usage, num_tokens=usage["num_tokens"] + j * len(out.decodes)),
                )
            )
        for seq in streamed.values():  # streaming requests still running: what they have so far
            if any(s.status is not SequenceStatus.FINISHED for s in seq.group):
                self._ready.append(self.outputs.output(seq))
        if len(self.stats) >= 2 * STATS_WINDOW:  # bounded: the last STATS_WINDOW steps or more
            del self.stats[:-STATS_WINDOW]
        self.stats += records  # last: a failure above leaves them as they were
        self.num_forwards += len(records)

    def _prompt_list(self, prompts) -> list:
        """`prompts` as a list: one str, list of ids or 1-D tensor/array is one prompt."""
        if isinstance(prompts, (str, bytes, bytearray)):
            return [prompts]
        if isinstance(prompts, (torch.Tensor, np.ndarray)):  # 2-D: a prompt per row; others are one prompt
            return list(prompts) if prompts.ndim == 2 else [prompts]  # (not 1-D: encode says its shape)
        if not isinstance(prompts, (list, tuple)):
            raise InvalidTypeError(
                f"prompts must be a str, a list of token ids, or a list of such prompts; got "
                f"{type(prompts).__name__} {prompts!r}"
            )
        # a list of ids (or of other scalars, refused later with their position) is one prompt
        prompt_like = (str, bytes, bytearray, list, tuple, range, torch.Tensor, np.ndarray)
        one = bool(prompts) and not isinstance(prompts[0], prompt_like)
        return [prompts] if one else list(prompts)

    def generate(
        self,
        prompts,
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run `prompts` to completion, outputs in prompt order. All are checked before any is queued; on
        Ctrl-C or a failure they are aborted and the engine stays usable. Final outputs only."""
        if self.has_unfinished_requests():
            raise EngineStateError(
                "generate() needs an idle engine; finish the requests already added with step() "
                "(or abort_request() them)"
            )
        prompts = self._prompt_list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise InvalidArgumentError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        else:
            params = [params] * len(prompts)
        params = [
            replace(p, output_kind="final_only")
            if isinstance(p, SamplingParams) and p.output_kind != "final_only"
            else p  # final_only params are kept as they are (no copy)
            for p in params
        ]
        pairs = enumerate(zip(prompts, params, strict=True))
        requests = [self._new_request(x, p, self._next_id + i) for i, (x, p) in pairs]
        for seqs in requests:  # every one was checked: none of these can fail
            self.scheduler.add(seqs)
        self._next_id += len(requests)
        ids = [seqs[0].request_id for seqs in requests]
        try:
            results = self._run_until_done(set(ids), use_tqdm)
        except BaseException:  # Ctrl-C or a failed step: drop this run's requests, keep the engine usable
            with DeferSigint(hold=True):  # a second Ctrl-C must not stop the cleanup halfway
                for i in ids:
                    self.abort_request(i)
                self._ready = [o for o in self._ready if o.request_id not in set(ids)]
            raise
        return [results[i] for i in ids]

    def _run_until_done(self, wanted: set, use_tqdm: bool) -> dict[int, RequestOutput]:
        """Step until every request in `wanted` finished."""
        results: dict[int, RequestOutput] = {}
        bar, tokens, t0 = None, [0, 0], time.perf_counter()  # prompt and output tokens of its steps
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(wanted), desc="requests", unit="req")
        try:
            while wanted - results.keys():
                num_forwards = self.num_forwards
                done = [o for o in self.step() if o.finished]
                results.update((o.request_id, o) for o in done)
                if bar is not None:
                    if self.num_forwards > num_forwards:  # the step ran: its stats are the last ones
                        tokens[0] += self.stats[-1].num_prefill_tokens
                        tokens[1] += self.stats[-1].num_generated
                    seconds = time.perf_counter() - t0
                    prompt, output = tokens[0] / seconds, tokens[1] / seconds
                    bar.set_postfix_str(f"input {prompt:.0f} tok/s, output {output:.0f} tok/s", refresh=False)
                    bar.update(sum(o.request_id in wanted for o in done))
        finally:
            if bar is not None:
                bar.close()
        return results
