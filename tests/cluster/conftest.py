"""The simulated clusters of these tests must not leak into later tests: ``ray.init(address=...)`` exports
RAY_ADDRESS (and joining a cluster may set RAY_AUTH_MODE), which every later ``ray.init()`` in this process
would follow to a cluster that no longer exists."""

from __future__ import annotations

import os

import pytest

_KEYS = ("RAY_ADDRESS", "RAY_AUTH_MODE")


@pytest.fixture(autouse=True)
def _restore_ray_environment():
    before = {key: os.environ.get(key) for key in _KEYS}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
