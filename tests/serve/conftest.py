"""Fixtures of the API tests over one in-process engine (the tiny seeded model, no Ray).

A test module that serves something else (a smaller queue, the Ray Serve app) defines its own
``backend`` or ``app``, which takes precedence over these."""

from __future__ import annotations

import pytest

from openai_helpers import app_for, local_backend


@pytest.fixture(scope="module")
def backend():
    b = local_backend()
    yield b
    b.close()


@pytest.fixture(scope="module")
def app(backend):
    return app_for(backend)
