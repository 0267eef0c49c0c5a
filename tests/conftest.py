"""Shared fixtures: one Ray instance per test session, seeded tiny models, GPU skipping."""

from __future__ import annotations

import os

import pytest


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover - torch is a core dependency
        return False


HAS_CUDA = _has_cuda()
# Without a GPU, Triton kernels run under the interpreter; set before any triton import. On a GPU
# machine they compile (the interpreter there would only make the GPU tests slow).
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.nodeid.split("/") or item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.gpu)
            if not HAS_CUDA:
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
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}
                         | ({} if HAS_CUDA else {"TRITON_INTERPRET": "1"})},
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_http(ray_session):
    """Ray Serve of the test session, its HTTP proxy on a free loopback port; the base URL.

    Serve keeps the HTTP options of whoever starts it first, so every test that deploys an app
    depends on this fixture (never ``serve.start`` or a bare ``serve.run`` before it).
    """
    import socket

    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
