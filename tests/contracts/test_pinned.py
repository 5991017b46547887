"""Our clients, adapters, launcher and Python API use against the pinned vLLM, SGLang, NIXL, megatron-core."""

from __future__ import annotations

import pytest

from slipstream.contracts.check import count_http
from slipstream.contracts.descriptions import check_descriptions
from slipstream.contracts.flags import check_launch
from slipstream.contracts.http import check_http
from slipstream.contracts.ours import record_launch_argv
from slipstream.contracts.problems import dedupe
from slipstream.contracts.pyapi import check_python_api
from slipstream.contracts.responses import check_replies

pytestmark = pytest.mark.contracts


def _report(problems) -> str:
    return "\n".join(str(p) for p in dedupe(problems))


@pytest.fixture(scope="module")
def calls(recorded):
    calls, errors = recorded
    assert not errors, errors
    return calls


def test_http_requests_match_upstream_routes_and_models(pinned_trees, calls):
    assert count_http(calls)["endpoints"] >= 20
    problems = check_http(pinned_trees, calls)
    assert not problems, _report(problems)


def test_server_descriptions_match_upstream_and_name_every_endpoint_we_call(pinned_trees, calls):
    problems = check_descriptions(pinned_trees, calls)
    assert not problems, _report(problems)


def test_reply_fields_our_parsers_read_exist_upstream(pinned_trees, calls):
    problems = check_replies(pinned_trees, calls)
    assert not problems, _report(problems)


def test_launch_flags_exist_in_upstream_parsers(pinned_trees):
    argvs = record_launch_argv()
    assert {a.kind for a in argvs} == {"vllm", "sglang"}
    problems = check_launch(pinned_trees, argvs)
    assert not problems, _report(problems)


@pytest.mark.parametrize("package", ["nixl", "megatron"])
def test_python_api_use_matches_upstream(pinned_trees, package):
    problems, checked = check_python_api(pinned_trees[package], package)
    assert checked >= 10, f"only {checked} uses of {package} found"
    assert not problems, _report(problems)
