"""Shared fixtures: one Ray instance per test session, seeded tiny models, GPU skipping."""

from __future__ import annotations

import os

import pytest

# Triton kernels run under the interpreter on CPU; set before any triton import.
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a core dependency
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.nodeid.split("/") or item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.gpu)
            if not has_cuda:
                item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def ray_session():
    """The one local Ray instance of the test session (started lazily, shut down at the end).

    Logical CPUs are oversubscribed on purpose: actors of the tiny model mostly wait on each
    other, and the CI machine has two cores.
    """
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(
            num_cpus=32,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            runtime_env={"env_vars": {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}},
        )
    yield ray
    ray.shutdown()
