"""SGLang's client, defined with the rest of the ``sglang`` server kind in ``slipstream.serverkinds.sglang``;
importable from here as before."""

from slipstream.serverkinds.sglang import SGLangClient, build_generate_payload, parse_generate_response

__all__ = ["SGLangClient", "build_generate_payload", "parse_generate_response"]
