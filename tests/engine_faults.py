"""Faults injected into an engine's forward, for the tests that check a failed step is undone."""

import contextlib


@contextlib.contextmanager
def fails_once_per_step(engine, error: type[BaseException] = RuntimeError, enabled: bool = True):
    """The engine's forward fails once in every step, after it ran (its KV cache writes done): the step is
    rolled back and the next step() retries it. Puts the forward back on exit (the model is shared by a
    module's tests). enabled=False leaves the forward alone, for the clean run to compare with."""
    if not enabled:
        yield
        return
    original, failed = engine.model.forward, set()

    def forward(*args, **kwargs):
        logits = original(*args, **kwargs)
        if engine.num_forwards not in failed:  # (the committed steps so far)
            failed.add(engine.num_forwards)
            raise error("injected after the KV writes")
        return logits

    engine.model.forward = forward
    try:
        yield
    finally:
        del engine.model.forward


def corrupt_first_page(engine, monkeypatch) -> None:
    """Every later step's inputs carry a page id far outside the pool in block_tables[0, 0]."""
    build = engine.runner.prepare_inputs

    def corrupt(out, block_manager):
        input_ids, positions, meta = build(out, block_manager)
        meta.block_tables[0, 0] = 10**6
        return input_ids, positions, meta

    monkeypatch.setattr(engine.runner, "prepare_inputs", corrupt)
