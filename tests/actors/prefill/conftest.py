"""Fixtures of the prefill pool tests: the tiny deployment, its model in this process (the
single-instance reference) and a pool of 4 instances on 2 nodes (a module that needs another
shape defines its own ``pool``)."""

from __future__ import annotations

import pytest
import torch

from tetris.config import load_deployment


@pytest.fixture(scope="module")
def deployment():
    return load_deployment("tiny-cpu.toml")


@pytest.fixture(scope="module")
def pool(ray_session, deployment):
    from tetris.actors.prefill.pool import PrefillPool

    p = PrefillPool(deployment, num_instances=4, node_size=2, timeout_s=8.0)
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def model(deployment):
    from tetris.model.loader import load_model

    torch.set_num_threads(1)
    return load_model(deployment.model)[0]
