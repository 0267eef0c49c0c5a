"""Fixtures the decode actor tests share."""

from __future__ import annotations

import asyncio

import pytest


@pytest.fixture(scope="module")
def loop():
    """One event loop per test module: the served instances' coroutines run on it."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()
