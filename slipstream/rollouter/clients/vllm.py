"""vLLM's client, defined with the rest of the ``vllm`` server kind in ``slipstream.serverkinds.vllm``;
importable from here as before."""

from slipstream.serverkinds.vllm import (
    VLLMClient,
    build_completions_payload,
    build_generate_payload,
    parse_completions_response,
    parse_generate_response,
)

__all__ = [
    "VLLMClient",
    "build_completions_payload",
    "build_generate_payload",
    "parse_completions_response",
    "parse_generate_response",
]
