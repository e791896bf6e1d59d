"""The engine: requests in, tokens out, many requests sharing one paged KV cache.

    engine = LLMEngine.from_pretrained("path/to/llama", num_blocks=512)
    outputs = engine.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))

Each `step()` asks the scheduler for a batch (running sequences decode one token; waiting prompts are
admitted while blocks allow), runs ONE forward of the model over all of it, samples one token per
sequence from that sequence's own seeded generator, and retires the finished ones. `stats` keeps one
`StepStats` per step: batch size, blocks used and free, slots holding tokens vs slots allocated,
preemptions, tokens generated.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from vllmini.errors import VllminiError
from vllmini.kv_cache import PagedKVCache
from vllmini.model import LlamaModel
from vllmini.scheduler import POLICIES, Scheduler, Sequence

BACKENDS = ("auto", "torch", "cupy", "emulator")


@dataclass
class SamplingParams:
    """How to pick each next token. temperature 0 = greedy; top_k None = off; top_p 1.0 = off.

    seed None: the engine derives one from its own seed and the request number, so runs repeat.
    The request stops at max_tokens ("length"), or at an id of stop_token_ids or the model's EOS
    ("stop"; the stop token is kept in output_token_ids). ignore_eos=True generates past EOS.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be None (off) or an int >= 1, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be None or an int, got {self.seed!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]


@dataclass
class RequestOutput:
    """A finished request. text is None without a tokenizer; finish_reason "length" or "stop"."""

    request_id: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str | None
    finish_reason: str


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


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from logits (vocab,) under `params`, drawing only from `generator`."""
    if params.temperature == 0.0:
        return int(logits.argmax())
    logits = logits.float() / params.temperature  # (V,)
    if params.top_k is not None and params.top_k < logits.numel():
        top = logits.topk(params.top_k)  # keep exactly the k largest
        logits = torch.full_like(logits, float("-inf")).scatter(0, top.indices, top.values)
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the ones ranked above it already reach top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))


class LLMEngine:
    """Continuous batching over a paged KV cache (policy "paged"), or a static baseline."""

    def __init__(
        self,
        model,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float | None = None,
        max_model_len: int | None = None,
        backend: str = "auto",
        policy: str = "paged",
        watermark: float = 0.01,
        max_num_seqs: int = 256,
        seed: int = 0,
    ):
        if not isinstance(model, LlamaModel):
            model = LlamaModel.from_pretrained(model)  # e.g. a transformers LlamaForCausalLM
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        cfg = model.config
        max_model_len = max_model_len or cfg.max_position_embeddings
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{cfg.max_position_embeddings}"
            )
        self.model, self.policy, self.max_model_len = model, policy, max_model_len
        self.device, self.seed = model.device, seed
        if num_blocks is None and kv_cache_memory is None and gpu_memory_utilization is None:
            if self.device.type == "cuda":
                gpu_memory_utilization = 0.9
            else:  # CPU: room for 8 sequences of max_model_len, at most 1 GiB
                per_block = PagedKVCache.bytes_per_block(
                    cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, block_size, model.dtype
                )
                num_blocks = max(1, min(8 * -(-max_model_len // block_size), 2**30 // per_block))
        self.kv_cache = PagedKVCache(
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            block_size,
            num_blocks=num_blocks,
            memory_bytes=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            dtype=model.dtype,
            device=self.device,
        )
        self.scheduler = Scheduler(
            self.kv_cache.num_blocks,
            block_size,
            max_model_len,
            policy=policy,
            watermark=watermark,
            max_num_seqs=max_num_seqs,
        )
        self.backend = self._resolve_backend(backend)  # "torch", "cupy" or "emulator"
        self.tokenizer, self.eos_token_ids = model.tokenizer, set(model.eos_token_ids)
        self.stats: list[StepStats] = []
        self.num_forwards = 0
        self._next_id = 0

    @classmethod
    def from_pretrained(
        cls,
        path_or_model,
        *,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        **engine_kwargs,
    ) -> LLMEngine:
        """Load a Llama checkpoint directory (or transformers model) and build an engine on it."""
        return cls(LlamaModel.from_pretrained(path_or_model, dtype=dtype, device=device), **engine_kwargs)

    def _resolve_backend(self, backend: str) -> str:
        """The decode backend to use. An explicit one that cannot run this dtype/device fails now, not at
        the first decode; "auto" falls back to "torch" when the CUDA kernel cannot run this model."""
        from vllmini.attention import paged_attention, resolve_backend

        concrete = resolve_backend(backend, self.device) if backend == "auto" else backend
        if concrete == "torch":
            return "torch"
        c = self.model.config
        kc = self.kv_cache.key_caches[0][:1]  # (1, block_size, nkv, hd): a one-block probe
        q = torch.zeros(1, c.num_attention_heads, c.head_dim, dtype=self.model.dtype, device=self.device)
        one = torch.ones(1, 1, dtype=torch.int32, device=self.device)
        try:
            paged_attention(q, kc, kc, one - 1, one[0], backend=concrete)
        except Exception as e:
            if backend == "auto":
                return "torch"
            raise ValueError(
                f"backend {backend!r} cannot run this model ({self.model.dtype} on {self.device}): {e}"
            ) from e
        return concrete

    # -------------------------------------------------------------------------
    # requests

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TypeError(
                    "string prompts need a tokenizer (tokenizer.json in the checkpoint); "
                    "pass token ids instead"
                )
            return self.tokenizer.encode(prompt).ids
        ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:5]}")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. ValueError if it could never run (too long for
        max_model_len, or for the whole KV pool)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = self._encode(prompt)
        if not ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        rid = self._next_id
        # no seed given: derive one from the engine's seed and the request number (string seeds are hashed
        # with SHA-512, so nearby numbers give unrelated streams)
        seed = params.seed if params.seed is not None else random.Random(f"{self.seed}:{rid}").getrandbits(63)
        seq = Sequence(rid, ids, params.max_tokens, seed=seed, device=self.device, sampling_params=params)
        self.scheduler.add(seq)  # raises before anything changed when it cannot fit
        self._next_id += 1
        return rid

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # -------------------------------------------------------------------------
    # one step

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward over the whole batch, sample; returns requests that finished."""
        sched = self.scheduler
        t0 = time.perf_counter()
        before = sched.num_preemptions
        out = sched.schedule()
        usage = sched.usage()
        if out.is_empty:
            if sched.has_unfinished():  # cannot happen: add_request only queues what fits alone
                raise VllminiError(f"no sequence could be scheduled with {len(sched.waiting)} waiting")
            return []
        input_ids, positions, meta = sched.build_inputs(out, device=self.device)
        logits = self.model(input_ids, positions, self.kv_cache, meta, backend=self.backend)  # (S, V)
        self.num_forwards += 1
        greedy = logits.argmax(-1).tolist()  # one host sync for all greedy rows
        finished = []
        for i, seq in enumerate(out.seqs):
            p = seq.sampling_params
            token = greedy[i] if p.temperature == 0.0 else sample(logits[i], p, seq.generator)
            seq.output_token_ids.append(token)
            if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
                reason = "stop"
            elif len(seq.output_token_ids) >= seq.max_tokens:
                reason = "length"
            else:
                continue
            sched.finish(seq, reason)
            finished.append(self._output(seq))
        self.stats.append(
            StepStats(
                step=len(self.stats),
                num_prefills=len(out.prefills),
                num_decodes=len(out.decodes),
                num_waiting=len(sched.waiting),
                num_preemptions=sched.num_preemptions - before,
                num_generated=len(out.seqs),
                num_finished=len(finished),
                seconds=time.perf_counter() - t0,
                **usage,
            )
        )
        return finished

    def _output(self, seq: Sequence) -> RequestOutput:
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        return RequestOutput(
            seq.seq_id, list(seq.prompt_token_ids), list(seq.output_token_ids), text, seq.finish_reason
        )

    def generate(
        self,
        prompts: list,
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run `prompts` (token-id lists, or strings with a tokenizer) to completion, in prompt order.

        All requests are validated before any is queued."""
        if self.has_unfinished_requests():
            raise VllminiError(
                "generate() needs an idle engine; finish the requests already added with step()"
            )
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt
        params = params if params is not None else SamplingParams()
        params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        for prompt, p in zip(prompts, params, strict=True):  # dry run: reject before queueing anything
            ids = self._encode(prompt)
            if not ids:
                raise ValueError("the prompt is empty: it needs at least one token")
            self.scheduler.check_fits(Sequence(-1, ids, p.max_tokens, seed=0, sampling_params=p))
        ids = [self.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        results: dict[int, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="requests", unit="req")
        wanted = set(ids)
        while wanted - results.keys():
            done = self.step()
            for o in done:
                results[o.request_id] = o
            if bar is not None:
                bar.update(sum(o.request_id in wanted for o in done))
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]
