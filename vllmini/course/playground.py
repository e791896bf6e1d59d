"""The state behind the page-table explorer: a `BlockManager` with a prefix cache, and the token ids of
every sequence, so that sharing can be tried by hand without a model.

Every action is one manager call (or a few, undone together on an error) and returns a one-line message
saying what happened: the slots written, copy-on-write pairs, prefix-cache hits, blocks that stay cached
when a sequence is freed, cached blocks evicted to make room. Token ids are made up unless given (a
tokenizer's, `add_tokens`/`append(..., token_ids=)`): each made-up token gets a negative id no other token
has, so two sequences share a cached prefix only when one was started from the other's tokens
(`add(..., prefix_of=seq)`) or both start with the same given ids. A block's tokens count as computed as
soon as they are added (there is no model here), so full blocks are named in the prefix cache right away.
"""

from __future__ import annotations

import copy

from vllmini.block_manager import BlockManager
from vllmini.checks import as_int, as_token_ids, cdiv
from vllmini.course.style import CACHED_FREE, RESERVED, plural
from vllmini.errors import InvalidArgumentError, OutOfBlocksError

MAX_SAMPLES = 8  # a fork makes at most this many samples (the picture stays readable)


def _shown(slots: list[int]) -> str:
    return str(slots) if len(slots) <= 8 else f"[{slots[0]}, ..., {slots[-1]}]"


def _ids(seq_ids: list) -> str:
    return f"seq {seq_ids[0]}" if len(seq_ids) == 1 else f"seqs {', '.join(map(str, seq_ids))}"


def free_blocks_text(manager: BlockManager) -> str:
    """The pool's free blocks in the words the status line, the errors and the legend share: "5 of 16
    blocks free (2 of them cached but free; 1 reserved by the watermark)". Cached-but-free blocks are
    free: a new block evicts one (least recently used first) when no plain free block is left."""
    free, cached, mark = manager.num_free_blocks, manager.num_cached_free_blocks, manager.watermark_blocks
    notes = [f"{cached} of them {CACHED_FREE}"] if cached else []
    notes += [f"{mark} {RESERVED}"] if mark else []
    notes = f" ({'; '.join(notes)})" if notes else ""
    return f"{free} of {plural(manager.num_blocks, 'block')} free{notes}"


def _prefix_note(found: list[int], head: int, num_tokens: int, block_size: int, source) -> str:
    """What the prefix cache did for a new sequence whose first `head` tokens are `source`'s: which
    blocks it found, and why it found no more (the last prompt token is always recomputed)."""
    whole = head // block_size  # blocks made only of the source's tokens
    lookable = (num_tokens - 1) // block_size  # the block holding the last token is never looked up
    wanted = min(whole, lookable)
    if wanted == 0:
        if whole == 0:
            return (
                f"no prefix-cache hit: seq {source}'s first {plural(head, 'token')} fill no whole block "
                f"(only full blocks of {block_size} tokens are cached)"
            )
        return (
            "no prefix-cache hit: the prompt's only full block holds its last token, which is always "
            "recomputed (its logits give the next token)"
        )
    note = (
        f"prefix cache hit: shares {plural(len(found), 'block')} {found}" if found else "no prefix-cache hit"
    )
    if len(found) < wanted:
        note += f"; block {len(found)} of seq {source}'s prefix is not cached (evicted, or never full)"
    if whole > lookable:
        note += (
            f"; block {lookable} holds the prompt's last token: always recomputed (its logits give the "
            "next token), so not shared"
        )
    return note


def _given(token_ids) -> list[int]:
    """Given token ids: a non-empty list of ints, each at least 0 (negative ids are the made-up ones)."""
    token_ids = as_token_ids(token_ids, "token_ids")
    if not token_ids or min(token_ids) < 0:
        raise InvalidArgumentError(f"token_ids must be a non-empty list of ids >= 0, got {token_ids!r}")
    return token_ids


def _common_start(a: list[int], b: list[int]) -> int:
    """How many ids `a` and `b` start with in common."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class PageTablePlayground:
    """Add, grow, fork, free and step sequences on one pool; all-or-nothing, each with a message."""

    def __init__(
        self, num_blocks: int, block_size: int, prefix_caching: bool = True, watermark_blocks: int = 0
    ):
        self.manager = BlockManager(
            num_blocks, block_size, watermark_blocks=watermark_blocks, enable_prefix_caching=prefix_caching
        )
        self.next_seq_id = 0
        self.tokens: dict[int, list[int]] = {}  # token ids of every sequence ever added (freed ones too)
        self.hashes: dict[int, list[bytes]] = {}  # hash chain of each live sequence's full blocks
        self.last_copies: list[tuple[int, int]] = []  # copy-on-write pairs of the last action
        self._next_token = 0

    def _fresh(self, count: int) -> list[int]:
        """`count` token ids never used before, all negative (so no accidental prefix-cache hit, and
        never a tokenizer's id)."""
        self._next_token += count
        return list(range(-self._next_token, -self._next_token + count))

    def _cached_free(self) -> dict[int, bytes]:
        """Cached blocks nobody holds, with their hashes."""
        cache = self.manager.prefix_cache
        return {b: cache.hash_of(b) for b in cache.evictable} if cache is not None else {}

    def _on_a_copy(self, change):
        """Run `change(manager)` on a copy of the manager and keep the copy only if it succeeds. A failed
        step (several appends) must leave the picture exactly as it was, cached blocks included;
        BlockManager.restore, the engine's rollback, forgets blocks evicted in between (safe there: they
        are recomputed), so the explorer works on a copy instead (a small pool: cheap)."""
        trial = copy.deepcopy(self.manager)
        result = change(trial)
        self.manager = trial
        return result

    def _commit(self, seq_id, start: int) -> None:
        """The tokens from `start` on count as computed: name the blocks they filled."""
        end = self.manager.seq_len(seq_id)
        self.manager.cache_full_blocks(seq_id, self.tokens[seq_id], self.hashes[seq_id], start, end)

    def _finish(self, message: str, slots: list[int], cached_before: dict[int, bytes]) -> str:
        """Take the action's copy-on-write pairs (the KV cache owner's job) and say what happened."""
        self.last_copies = self.manager.take_pending_copies()
        if slots:
            message += f" → slots {_shown(slots)}"
        for src, dst in self.last_copies:
            message += f"; copy-on-write: block {src} → {dst}"
        cache = self.manager.prefix_cache
        # evicted: its hash entry is gone (the block may already be named again, for its new tokens)
        evicted = sorted(b for b, h in cached_before.items() if cache is not None and cache.hash_of(b) != h)
        if evicted:
            blocks = "block" if len(evicted) == 1 else "blocks"
            message += f"; evicted cached {blocks} {evicted} (least recently used)"
        return message

    def add(self, num_tokens: int, prefix_of=None) -> str:
        """A new sequence of `num_tokens` tokens; with `prefix_of`, its first tokens are that sequence's
        (live or freed), and its full blocks found in the prefix cache are shared, not allocated."""
        num_tokens = as_int(num_tokens, "num_tokens", min=1)
        if prefix_of is not None and prefix_of not in self.tokens:
            raise InvalidArgumentError(f"prefix_of={prefix_of!r} is no sequence; known: {list(self.tokens)}")
        head = self.tokens[prefix_of][:num_tokens] if prefix_of is not None else []
        return self._add(head + self._fresh(num_tokens - len(head)), prefix_of, len(head))

    def add_tokens(self, token_ids: list[int]) -> str:
        """A new sequence of the given token ids (a tokenizer's: at least 0). Told as `add(...,
        prefix_of=s)` for the sequence s that starts with the most of the same ids (live or freed): the
        prefix cache finds the same blocks, by the same hashes."""
        token_ids = _given(token_ids)
        heads = {s: _common_start(t, token_ids) for s, t in self.tokens.items()}
        source = max(heads, key=heads.get, default=None)
        if source is None or heads[source] == 0:
            return self._add(token_ids, None, 0)
        return self._add(token_ids, source, heads[source])

    def _add(self, token_ids: list[int], prefix_of, head: int) -> str:
        """Add a sequence of `token_ids`, the first `head` of them `prefix_of`'s (None: no source)."""
        num_tokens, hashes = len(token_ids), []
        shared = self.manager.cached_prefix(token_ids, hashes)
        seq_id, before = self.next_seq_id, self._cached_free()
        if not self.manager.can_allocate(num_tokens, shared):
            needed = self.manager.blocks_needed(num_tokens, shared)
            found = f" ({plural(len(shared), 'block')} found in the prefix cache)" if shared else ""
            raise OutOfBlocksError(
                f"seq {seq_id} with {plural(num_tokens, 'token')} needs {plural(needed, 'new block')}"
                f"{found}, but {free_blocks_text(self.manager)}"
            )
        slots = self.manager.allocate(seq_id, num_tokens, shared=shared)
        self.next_seq_id += 1
        self.tokens[seq_id], self.hashes[seq_id] = token_ids, hashes
        self._commit(seq_id, 0)
        message = f"added seq {seq_id} with {plural(num_tokens, 'token')}"
        if prefix_of is not None:
            message += f", the first {head} from seq {prefix_of}"
            if self.manager.prefix_cache is not None:
                message += "; " + _prefix_note(shared, head, num_tokens, self.manager.block_size, prefix_of)
        return self._finish(message, slots, before)

    def append(self, seq_id, num_tokens: int, token_ids: list[int] | None = None) -> str:
        """Grow `seq_id` by `num_tokens` tokens (copy-on-write if its last block is shared and partial);
        `token_ids`: their ids (a tokenizer's, as many as `num_tokens`; default: made up)."""
        table = self.manager.block_table(seq_id)  # an unknown seq_id raises here, before any change
        num_tokens = as_int(num_tokens, "num_tokens", min=1)
        token_ids = self._fresh(num_tokens) if token_ids is None else _given(token_ids)
        if len(token_ids) != num_tokens:
            raise InvalidArgumentError(f"token_ids must hold num_tokens={num_tokens} ids, got {token_ids!r}")
        start, before = table.num_tokens, self._cached_free()
        needed = table.num_new_blocks(num_tokens)
        if needed > self.manager.num_free_blocks:
            grow = cdiv(start + num_tokens, self.manager.block_size) - table.num_blocks
            copy_note = " (one of them a copy of its shared last block)" if needed > grow else ""
            raise OutOfBlocksError(
                f"appending {plural(num_tokens, 'token')} to seq {seq_id} needs {plural(needed, 'new block')}"
                f"{copy_note}, but {free_blocks_text(self.manager)}"
            )
        slots = self._on_a_copy(lambda manager: manager.append(seq_id, num_tokens))
        self.tokens[seq_id] = self.tokens[seq_id][:start] + token_ids
        self._commit(seq_id, start)
        return self._finish(f"appended {plural(num_tokens, 'token')} to seq {seq_id}", slots, before)

    def fork(self, seq_id, num_samples: int = 2) -> tuple[list[int], str]:
        """Make `seq_id` one of `num_samples` samples: num_samples - 1 new sequences (the next ids) that
        share every block of it (reference counts go up, nothing is allocated). Returns their ids."""
        num_samples = as_int(num_samples, "num_samples", min=2, max=MAX_SAMPLES)
        self.manager.block_table(seq_id)  # an unknown seq_id raises here, before any change
        children = list(range(self.next_seq_id, self.next_seq_id + num_samples - 1))
        for child in children:
            self.manager.fork(seq_id, child)
            self.tokens[child], self.hashes[child] = list(self.tokens[seq_id]), list(self.hashes[seq_id])
        self.next_seq_id += len(children)
        return children, self._finish(f"forked seq {seq_id} into {_ids(children)}", [], {})

    def free(self, seq_id) -> str:
        """Finish `seq_id`: its blocks go back; full ones named in the prefix cache stay cached (free,
        but findable by their hash until evicted)."""
        before = self._cached_free()
        self.manager.free(seq_id)
        self.hashes.pop(seq_id, None)
        kept = sorted(self._cached_free().keys() - before.keys())
        message = f"freed seq {seq_id}"
        if kept:
            stay = "stays" if len(kept) == 1 else "stay"
            message += (
                f"; {plural(len(kept), 'block')} {kept} {stay} cached (free, found again by their hash)"
            )
        return self._finish(message, [], before)

    def step(self) -> str:
        """One decode step: every live sequence samples one token (a copy-on-write where it writes into a
        shared, partly filled block). All or nothing: if the pool runs out, nothing changes."""
        seq_ids = self.manager.seq_ids
        if not seq_ids:
            raise InvalidArgumentError("step needs a sequence: add one first")
        before, starts = self._cached_free(), {s: self.manager.seq_len(s) for s in seq_ids}
        try:
            slots = self._on_a_copy(lambda manager: [manager.append(s, 1)[0] for s in seq_ids])
        except (
            OutOfBlocksError
        ):  # say what the whole step needs, not what the first sequence short of it does
            raise OutOfBlocksError(
                f"step needs {plural(self._step_needs(seq_ids), 'new block')} (one for each sequence whose "
                f"last block is full, or shared and partly full), but {free_blocks_text(self.manager)}"
            ) from None
        for s in seq_ids:
            self.tokens[s] = self.tokens[s][: starts[s]] + self._fresh(1)
            self._commit(s, starts[s])
        return self._finish(f"step: {_ids(seq_ids)} sampled 1 token each", slots, before)

    def _step_needs(self, seq_ids: list) -> int:
        """New blocks a step takes: each sequence's, in order, on a copy (a copy-on-write by one sample
        can leave its siblings' block unshared)."""
        trial, needed = copy.deepcopy(self.manager), 0
        for s in seq_ids:
            count = trial.block_table(s).num_new_blocks(1)
            needed += count
            if count <= trial.num_free_blocks:
                trial.append(s, 1)
        return needed
