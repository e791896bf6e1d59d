"""Shared test set-up: hypothesis profiles, the GPU marker, and the engine tests' model (`hf`, its float64
copy `hf64`, and `model`: vllmini's float32 copy), built once per test module."""

import os

import pytest
from hypothesis import HealthCheck, settings

# 2-core CI machines are slow and uneven: no per-example deadline there.
settings.register_profile("ci", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# `make test` runs a pytest-xdist worker per core: each worker's torch then uses one thread. With torch's
# default (a thread per core) the workers' thread pools spin against each other: on 2 cores the course
# model's tests ran 5x slower than alone (350 s against 67 s).
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)


def gpu_available() -> bool:
    """True when torch sees a CUDA GPU and CuPy can use it."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU with CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def hf():
    pytest.importorskip("transformers")
    from llama_cases import engine_hf_model

    return engine_hf_model()


@pytest.fixture(scope="module")
def hf64(hf):
    from llama_cases import float64_copy

    return float64_copy(hf)


@pytest.fixture(scope="module")
def model(hf):
    import torch

    from vllmini.model import LlamaModel

    return LlamaModel.from_pretrained(hf, dtype=torch.float32)


@pytest.fixture
def steps_run(monkeypatch):
    """The num_steps of every multi-step the engines run (ModelRunner.execute_steps spied)."""
    from vllmini.model_runner import ModelRunner

    spy, execute_steps = [], ModelRunner.execute_steps
    monkeypatch.setattr(
        ModelRunner, "execute_steps", lambda *a: spy.append(a[1].num_steps) or execute_steps(*a)
    )
    return spy
