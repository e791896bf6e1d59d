"""Shared test set-up: hypothesis profiles and the GPU marker."""

import os

import pytest
from hypothesis import HealthCheck, settings

# 2-core CI machines are slow and uneven: no per-example deadline there.
settings.register_profile("ci", deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


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
