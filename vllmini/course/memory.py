"""Why the KV cache decides batch size: the arithmetic, and a small simulation.

Read in order: `kv_bytes_per_token` (what one token's keys and values cost), `sample_requests`
(synthetic workloads with the mean lengths of the PagedAttention paper, Kwon et al., SOSP 2023; the
engine benchmark reuses it), then `reservation` and `requests_that_fit`: how much reserved KV memory
holds real tokens, and how many requests fit in a budget, when every request reserves `max_len` slots up
front ("static", like Orca (Max) in the paper) against when it holds only the blocks its tokens fill
("paged"). Nothing here allocates GPU memory or imports torch; it is arithmetic on lengths.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vllmini.checks import as_float, as_int, as_pair, cdiv, one_of
from vllmini.errors import InvalidArgumentError, InvalidTypeError

SCHEMES = ("static", "pow2", "oracle", "paged")
Requests = Sequence[tuple[int, int]]  # (input_len, output_len) of each request


# -----------------------------------------------------------------------------
# model shapes and KV bytes per token


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder-only transformer that fix its KV-cache size (from its config.json)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads: = num_heads for MHA, fewer for GQA, 1 for MQA
    head_size: int
    dtype_bytes: int = 2  # bytes per number, fp16/bf16; used for the KV cache and for weight_bytes
    num_params: int = 0  # parameter count, for the weights' memory (0 = unknown)

    def __post_init__(self):
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_size", "dtype_bytes"):
            object.__setattr__(self, field, as_int(getattr(self, field), field, min=1))  # frozen: no setattr
        object.__setattr__(self, "num_params", as_int(self.num_params, "num_params", min=0))
        if self.num_heads % self.num_kv_heads != 0:
            raise InvalidArgumentError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights in this dtype (0 when num_params is unknown)."""
        return self.num_params * self.dtype_bytes


# Shapes from the released checkpoints' config.json; num_params computed from the same configs
# (embeddings + layers + norms, and the untied lm_head for the Llamas).
LLAMA_2_7B = ModelShape("Llama-2-7B", 32, 4096, 32, 32, 128, num_params=6_738_415_616)
OPT_13B = ModelShape("OPT-13B", 40, 5120, 40, 40, 128, num_params=12_853_473_280)
LLAMA_3_8B = ModelShape("Llama-3-8B", 32, 4096, 32, 8, 128, num_params=8_030_261_248)
LLAMA_2_70B = ModelShape("Llama-2-70B", 80, 8192, 64, 8, 128, num_params=68_976_648_192)
TINYLLAMA_1_1B = ModelShape("TinyLlama-1.1B", 22, 2048, 32, 4, 64, num_params=1_100_048_384)
MODEL_SHAPES = (TINYLLAMA_1_1B, LLAMA_2_7B, LLAMA_3_8B, OPT_13B, LLAMA_2_70B)


def kv_bytes_per_token(shape: ModelShape) -> int:
    """Bytes one token's keys and values take over all layers: 2 * layers * kv_heads * head_size * bytes."""
    if not isinstance(shape, ModelShape):
        raise InvalidTypeError(f"shape must be a ModelShape, got {type(shape).__name__}")
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_size * shape.dtype_bytes


def kv_tokens_that_fit(shape: ModelShape, memory_bytes: int) -> int:
    """Tokens of KV cache that fit in `memory_bytes` after the weights (0 when the weights don't fit).
    Ignores activations, the CUDA context and allocator slack, so a real server fits fewer."""
    per_token = kv_bytes_per_token(shape)
    free = as_int(memory_bytes, "memory_bytes", min=0) - shape.weight_bytes
    return max(0, free // per_token)


# -----------------------------------------------------------------------------
# synthetic workloads

# workload -> (mean input, mean output, sigma input, sigma output). The means are the paper's
# (Kwon et al. 2023, Sec. 6.1); the lognormal sigmas are our choice (long right tails), not fitted.
WORKLOADS = {
    "sharegpt": (161.31, 337.99, 1.0, 0.8),
    "alpaca": (19.31, 58.45, 0.6, 0.9),
}


def sample_requests(
    n: int, workload: str = "sharegpt", max_len: int = 2048, seed: int = 0
) -> list[tuple[int, int]]:
    """Draw n synthetic (input_len, output_len) pairs, seeded.

    Each length is LogNormal(mu, sigma) with mu = ln(mean) - sigma**2 / 2, so that its mean is the
    paper's (WORKLOADS). Lengths are rounded to ints >= 1, then clipped as a server would: the prompt to
    at most max_len - 1, the output to max_len - input_len, so input_len + output_len <= max_len.
    Clipping lowers the means: at max_len 2048 by about 1.5% for ShareGPT's outputs and under 1%
    otherwise; by much more at small max_len (ShareGPT outputs: -9% at 1024, -32% at 512).
    """
    n = as_int(n, "n", min=0)
    one_of(workload, "workload", sorted(WORKLOADS))
    max_len = as_int(max_len, "max_len", min=2)  # one prompt and one output token
    mean_in, mean_out, sigma_in, sigma_out = WORKLOADS[workload]
    rng = np.random.default_rng(seed)
    inp = rng.lognormal(math.log(mean_in) - sigma_in**2 / 2, sigma_in, size=n)  # (n,)
    out = rng.lognormal(math.log(mean_out) - sigma_out**2 / 2, sigma_out, size=n)  # (n,)
    inp = np.clip(np.rint(inp), 1, max_len - 1).astype(np.int64)
    out = np.clip(np.rint(out), 1, max_len - inp).astype(np.int64)
    return [(int(i), int(o)) for i, o in zip(inp, out, strict=True)]


# -----------------------------------------------------------------------------
# reservation schemes: slots reserved for one request


def reserved_slots(
    final_len: int, scheme: str, *, max_len: int = 2048, block_size: int = 16, num_tokens: int | None = None
) -> int:
    """KV slots one request holds under `scheme`, when it will end at `final_len` tokens.

    static: max_len, reserved up front (Orca (Max) in the paper).
    pow2:   the next power of two >= final_len, at most max_len (Orca (Pow2): up to 2x too much).
    oracle: exactly final_len (Orca (Oracle): knows the output length in advance).
    paged:  whole blocks for the num_tokens it holds now (default: final_len), ceil(n / bs) * bs.
    The three contiguous schemes reserve for the final length even while the request is shorter.
    """
    one_of(scheme, "scheme", SCHEMES)
    final_len = as_int(final_len, "final_len", min=1)
    max_len = as_int(max_len, "max_len", min=1)
    if scheme != "paged" and final_len > max_len:
        raise InvalidArgumentError(
            f"final_len must be <= max_len={max_len} under scheme {scheme!r}, got {final_len}"
        )
    block_size = as_int(block_size, "block_size", min=1)
    held = final_len if num_tokens is None else as_int(num_tokens, "num_tokens", min=0, max=final_len)
    if scheme == "static":
        return max_len
    if scheme == "pow2":
        return min(1 << (final_len - 1).bit_length(), max_len)
    if scheme == "oracle":
        return final_len
    return cdiv(held, block_size) * block_size  # whole blocks


# -----------------------------------------------------------------------------
# snapshot of a set of live requests


@dataclass(frozen=True)
class Reservation:
    """KV slots reserved by a set of live requests, and how many of them hold real tokens."""

    num_requests: int
    tokens: int  # slots holding a token's K/V
    reserved_slots: int  # slots set aside for these requests

    @property
    def token_share(self) -> float:
        """Share of reserved slots holding real tokens (1.0 when nothing is reserved)."""
        return self.tokens / self.reserved_slots if self.reserved_slots else 1.0

    @property
    def wasted_slots(self) -> int:
        return self.reserved_slots - self.tokens


def _check_requests(requests: Requests, scheme: str, max_len: int) -> None:
    """A known scheme, and requests of at most max_len tokens (any length when paged)."""
    one_of(scheme, "scheme", SCHEMES)
    for req in requests:
        inp, out = as_pair(req, "each request (input_len, output_len)")
        inp = as_int(inp, f"input_len of request {req!r}", min=1)
        out = as_int(out, f"output_len of request {req!r}", min=0)
        if scheme != "paged" and inp + out > max_len:
            raise InvalidArgumentError(f"request {req!r} is longer than max_len={max_len}")


def reservation(
    requests: Requests, scheme: str, *, max_len: int = 2048, block_size: int = 16, progress: float = 1.0
) -> Reservation:
    """Slots reserved vs tokens held by `requests` (input_len, output_len), all live at once.

    `progress` is how much of its output every request has generated at the snapshot: 1.0 (default)
    is the moment each finishes, the best case for every scheme; 0.5 is halfway.
    """
    _check_requests(requests, scheme, max_len)
    progress = as_float(progress, "progress", min=0.0, max=1.0)
    tokens = reserved = 0
    for req in requests:
        held = req[0] + round(progress * req[1])  # the prompt and `progress` of the output
        tokens += held
        reserved += reserved_slots(sum(req), scheme, max_len=max_len, block_size=block_size, num_tokens=held)
    return Reservation(len(requests), tokens, reserved)


def static_reservation(requests: Requests, max_len: int, progress: float = 1.0) -> Reservation:
    """Every request reserves max_len slots up front (Orca (Max))."""
    return reservation(requests, "static", max_len=max_len, progress=progress)


def paged_reservation(requests: Requests, block_size: int, progress: float = 1.0) -> Reservation:
    """Every request holds ceil(tokens / block_size) blocks: at most block_size - 1 slots wasted each."""
    return reservation(requests, "paged", block_size=block_size, progress=progress)


def requests_that_fit(
    requests: Requests, kv_budget_tokens: int, scheme: str, *, max_len: int = 2048, block_size: int = 16
) -> int:
    """How many requests, admitted first-come first-served, fit in a budget of kv_budget_tokens slots.

    Each request is counted at its final length input_len + output_len (static schemes reserve for it
    up front; paging holds the blocks those tokens fill at the end). Admission stops at the first
    request that does not fit, as a FCFS scheduler that never skips ahead would.
    """
    kv_budget_tokens = as_int(kv_budget_tokens, "kv_budget_tokens", min=0)
    _check_requests(requests, scheme, max_len)
    used = 0
    for count, req in enumerate(requests):
        used += reserved_slots(sum(req), scheme, max_len=max_len, block_size=block_size)
        if used > kv_budget_tokens:
            return count
    return len(requests)
