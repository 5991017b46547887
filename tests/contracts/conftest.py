"""The `contracts` marker and the pinned upstream sources it needs.

Tests marked `contracts` read the pinned releases from the cache (``slipstream.contracts.cache``). A cold
cache is filled only when ``SLIPSTREAM_CONTRACTS_FETCH=1`` (``make contracts`` sets it); otherwise, and
when fetching fails (no network), those tests are skipped with the reason, so ``make test`` stays fast
and offline and runs them only once the cache is warm.
"""

from __future__ import annotations

import os

import pytest

FETCH_ENV = "SLIPSTREAM_CONTRACTS_FETCH"


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "contracts: checks against the pinned upstream releases (needs their cache)"
    )


@pytest.fixture(scope="session")
def pinned_variants():
    """Every release variant (``check.release_trees``): (project -> release, project -> source tree); the
    first has each project at its first release, each further one swaps one project's release (vLLM's CPU
    build)."""
    from slipstream.contracts import cache
    from slipstream.contracts.check import release_trees

    if not cache.is_warm():
        cold = ", ".join(p.requirement for p in cache.missing())
        if os.environ.get(FETCH_ENV) != "1":
            pytest.skip(
                f"contract cache {cache.cache_dir()} lacks {cold}: run `make contracts` to fetch them"
            )
        try:
            cache.ensure_all()
        except cache.FetchError as err:
            pytest.skip(f"contract cache is cold and the pinned releases cannot be fetched: {err}")
    return release_trees()


@pytest.fixture(scope="session")
def pinned_trees(pinned_variants):
    """Each project's source tree at its first release."""
    return pinned_variants[0][1]


@pytest.fixture(scope="session")
def recorded():
    """What our clients and adapters send (and read), recorded once: (calls, steps that failed)."""
    from slipstream.contracts.ours import record_http_calls

    errors: list[str] = []
    calls = record_http_calls(errors)
    return calls, errors
