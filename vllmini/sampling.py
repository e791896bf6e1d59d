"""Sampling (notebook 06): a request's options (SamplingParams), and a whole batch's tokens at once
(sample_batch), each request drawing only from its own seeded generator."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from vllmini.checks import as_bool, as_float, as_fraction, as_int, as_seed, as_token_ids, one_of
from vllmini.errors import InvalidArgumentError, InvalidTypeError

GREEDY_BELOW = 1e-5  # temperatures below this count as 0 (greedy): dividing by them overflows (as vLLM)
OUTPUT_KINDS = ("final_only", "cumulative", "delta")  # what step() returns of a request (vLLM's names)


@dataclass
class SamplingParams:
    """How to pick each next token, and when a request stops (vLLM's names)."""

    max_tokens: int = 16  # the most tokens it generates (finish_reason "length")
    temperature: float = 0.0  # 0 = greedy (as is any below GREEDY_BELOW)
    top_k: int | None = None  # None = off
    top_p: float = 1.0  # 1.0 = off
    seed: int | None = None  # None: derived from the engine's seed and the request number, so runs repeat
    stop_token_ids: list[int] = field(default_factory=list)  # ids that stop it (kept in the output)
    ignore_eos: bool = False  # True: generate past EOS
    n: int = 1  # samples of the prompt; sample 0 equals the n=1 result, sample i seeds `sample_seed(seed, i)`
    stop: list[str] = field(default_factory=list)  # strings that stop it: the text is cut before one
    # k: each token's log-probability and the k most likely ones' (raw logits, before temperature/top-k/p)
    logprobs: int | None = None
    output_kind: str = "final_only"  # what step() returns: OUTPUT_KINDS (generate: final outputs only)

    def __post_init__(self):
        self.max_tokens = as_int(self.max_tokens, "max_tokens", min=1)
        self.n = as_int(self.n, "n (samples per prompt)", min=1)
        self.temperature = as_float(self.temperature, "temperature (0 = greedy)", min=0.0)
        if self.top_k is not None:
            self.top_k = as_int(self.top_k, "top_k (None = off)", min=1)
        self.top_p = as_fraction(self.top_p, "top_p", "(0, 1]")
        if self.seed is not None:
            self.seed = as_seed(self.seed)
        self.stop_token_ids = as_token_ids(self.stop_token_ids, "stop_token_ids")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidArgumentError(f"stop_token_ids must be >= 0, got {self.stop_token_ids}")
        self.ignore_eos = as_bool(self.ignore_eos, "ignore_eos")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
            raise InvalidTypeError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop = list(stop)
        if self.logprobs is not None:
            self.logprobs = as_int(self.logprobs, "logprobs (top alternatives per token)", min=0)
        one_of(self.output_kind, "output_kind", OUTPUT_KINDS)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded `seed` (sample 0 keeps the request's own)."""
    return seed if index == 0 else random.Random(f"{seed}:{index}").getrandbits(63)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from logits (vocab,) under `params`, drawing only from `generator`."""
    [token] = sample_batch(logits[None], [0], [params], [generator])
    if isinstance(token, Exception):
        raise token
    return token


def sample_batch(
    logits: torch.Tensor, rows: list[int], params: list[SamplingParams], generators: list[torch.Generator]
) -> list[int | Exception]:
    """One token per entry: from logits[rows[j]] (logits: (S, V)) under params[j], drawing only from
    generators[j] (each entry's noise from its own generator: one batched draw would mix their streams); a
    failed draw gets its exception instead. Temperature, top-k, top-p and the draw are batched tensor ops."""
    # a row holding NaN or +inf has no distribution: its entries fail (-inf only masks a token)
    top, best = logits.max(-1)  # (S,) each: a row's largest logit (NaN or +inf if any is) and its argmax
    best, bad = torch.stack([best, (top < float("inf")).logical_not().long()]).tolist()  # (2, S): one sync
    tokens: list = [not_finite(r) if bad[r] else best[r] for r in rows]  # else the argmax greedy entries keep
    sampled = [j for j, p in enumerate(params) if not p.is_greedy and not bad[rows[j]]]
    if not sampled:
        return tokens
    x, vocab = logits[[rows[j] for j in sampled]].float(), logits.shape[1]  # (R, V)
    x = x / torch.tensor([params[j].temperature for j in sampled], device=x.device)[:, None]  # at temperature
    ks, ps = [min(params[j].top_k or vocab, vocab) for j in sampled], [params[j].top_p for j in sampled]
    if min(ks) < vocab or min(ps) < 1.0:  # (decided on the host: no device sync)
        # the K most likely, in order (K: the largest top_k; a full sort when some row has none)
        kmax = max(ks)
        if x.device.type == "cpu":  # numpy sorts ~8x faster than torch on the CPU (ties in either order)
            order = torch.from_numpy(np.argsort(-x.detach().numpy(), axis=-1)[:, :kmax])
            values = x.gather(1, order)  # (R, K)
        else:
            values, order = x.topk(kmax, -1) if kmax < vocab else x.sort(-1, descending=True)  # (R, K)
        rank = torch.arange(kmax, device=x.device)[None, :]  # (1, K)
        drop = rank >= torch.tensor(ks, device=x.device)[:, None]  # (R, K): past each row's top k
        if min(ps) < 1.0:
            top_p = torch.tensor(ps, device=x.device)[:, None]  # (R, 1)
            probs = values.masked_fill(drop, float("-inf")).softmax(-1)  # (R, K): the top k renormalized
            # drop a token when the ones ranked above it already reach top_p (the first always stays)
            drop |= (probs.cumsum(-1) - probs >= top_p) & (top_p < 1.0)
        kept = values.masked_fill(drop, float("-inf"))  # (R, K)
        x = torch.full_like(x, float("-inf")).scatter(1, order, kept)  # (R, V): the rest never drawn
    probs, noise = x.softmax(-1), torch.empty_like(x)  # (R, V) each
    for j, row in zip(sampled, noise.unbind(0), strict=True):  # each row's noise from its entry's generator
        try:
            _draw(row, params[j], generators[j])
        except Exception as e:  # this entry fails alone (its row is ignored); Ctrl-C rolls the step back
            tokens[j] = e
    chosen = (probs / noise).argmax(-1)  # (R,): all rows' draws at once
    no_dist = probs.isnan().any(-1)  # (R,): every logit was -inf
    for j, t, empty in zip(sampled, *torch.stack([chosen, no_dist.long()]).tolist(), strict=True):  # one sync
        if not isinstance(tokens[j], Exception):  # (a failed draw keeps its exception)
            tokens[j] = (
                InvalidArgumentError(f"logits row {rows[j]} has no finite logit to sample") if empty else t
            )
    return tokens


def not_finite(row: int) -> InvalidArgumentError:
    """The error of an entry whose logits row holds NaN or +inf: it has no distribution, and no argmax."""
    return InvalidArgumentError(f"logits row {row} holds NaN or +inf (not finite)")


def _draw(noise: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> torch.Tensor:
    """Fills one row's `noise` (V,) with Exp(1) noise from `generator`: argmax(probs / noise) is the token
    torch.multinomial(probs, 1, generator=generator) draws (the same stream: it divides and argmaxes so
    too), so the rows' divisions and argmaxes run batched while each keeps its own generator's stream."""
    return noise.exponential_(generator=generator)


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], ks: list[int]) -> list[dict]:
    """For each j: {token id: (logprob, rank)} of tokens[j] and the ks[j] most likely of logits[rows[j]]."""
    lp = logits[rows].float().log_softmax(-1)  # (R, V)
    chosen = torch.tensor(tokens, device=lp.device)[:, None]  # (R, 1)
    chosen_lp = lp.gather(1, chosen)  # (R, 1)
    ranks = (lp > chosen_lp).sum(-1) + 1  # (R,): 1 + tokens strictly more likely
    kmax = max(ks)
    top = lp.topk(kmax, -1) if kmax else None  # (R, kmax), sorted: rank i + 1
    chosen_lp, ranks = chosen_lp[:, 0].tolist(), ranks.tolist()
    top_lp, top_ids = (top.values.tolist(), top.indices.tolist()) if top is not None else ([], [])
    out = []
    for j, (token, k) in enumerate(zip(tokens, ks, strict=True)):
        entry = {token: (chosen_lp[j], ranks[j])}
        for i in range(k):
            entry.setdefault(top_ids[j][i], (top_lp[j][i], i + 1))
        out.append(entry)
    return out
