"""`slipstream serve --model PATH`: run the embedded inference server (engine + HTTP) in this process.

The model is loaded before the port is bound, so ``GET /health`` answering means the server can generate;
launchers (launch.py) wait for exactly that. Every field of :class:`EmbeddedServerConfig` is also a flag
(``--max-model-len 2048``, ``--kv-cache-tokens 65536`` ...), generated from the struct (its descriptions
are the ``--help`` text, cli_args.py) so the two never drift apart. The server binds loopback unless
``--host`` says otherwise.

Control and weight-update routes need the token in ``$SLIPSTREAM_SERVER_TOKEN`` (never a flag: the command
line is visible to every user in ``ps``). Beyond loopback the server refuses to start without one; on
loopback without one every route is open to local processes, and the server says so when it starts.

Example::

    slipstream serve --model ~/.cache/slipstream/models/smollm2-135m-instruct --port 30000 --num-threads 2
    curl -s localhost:30000/generate -d '{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}}'
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from slipstream.cli_args import add_config_options, command_parser, doc_paragraph
from slipstream.rollouter.config import EmbeddedServerConfig
from slipstream.utils.http_auth import TOKEN_ENV, check_bind, env_token
from slipstream.utils.net import LOOPBACK


def config_to_args(cfg: EmbeddedServerConfig) -> list[str]:
    """The flags that reproduce ``cfg`` on the command line (used by the launcher)."""
    args: list[str] = []
    for name, value in msgspec.structs.asdict(cfg).items():
        args += ["--" + name.replace("_", "-"), str(value)]
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("slipstream serve", doc_paragraph(__doc__))
    parser.add_argument("--model", required=True, help="HF checkpoint directory or a known model name")
    parser.add_argument("--host", default=LOOPBACK, help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--weight-version", type=int, default=0, help="version stamped on tokens until an update"
    )
    parser.add_argument("--log-level", default="warning", help="uvicorn log level")
    add_config_options(
        parser,
        EmbeddedServerConfig,
        dashed=True,
        title="server config (rollout.embedded.* in a run's config)",
    )
    return parser


def parse_config(ns: argparse.Namespace) -> EmbeddedServerConfig:
    given = {f.name: getattr(ns, f.name) for f in msgspec.structs.fields(EmbeddedServerConfig)}
    return msgspec.convert({k: v for k, v in given.items() if v is not None}, EmbeddedServerConfig)


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        cfg = parse_config(ns)
    except (msgspec.ValidationError, ValueError) as err:
        print(f"slipstream serve: invalid option: {err}", file=sys.stderr)
        return 2
    token = env_token()
    try:  # before loading anything: a refused bind fails at once
        check_bind(ns.host, token)
    except ValueError as err:
        print(f"slipstream serve: {err}", file=sys.stderr)
        return 2
    if not token:
        print(
            f"slipstream serve: no ${TOKEN_ENV}: pause, abort and weight updates are open to every process "
            "on this machine; set it to require a token",
            file=sys.stderr,
        )
    from slipstream.rollouter.models import resolve_model_path

    try:  # before the heavy imports, so a wrong path fails in a fraction of a second
        model_path = resolve_model_path(ns.model)
    except (FileNotFoundError, ValueError) as err:
        print(f"slipstream serve: {err}", file=sys.stderr)
        return 2
    import torch
    import uvicorn

    from slipstream.rollouter.embedded.app import build_app
    from slipstream.rollouter.embedded.engine import EmbeddedEngine

    if cfg.num_threads > 0:
        torch.set_num_threads(cfg.num_threads)
    engine = EmbeddedEngine(model_path, cfg, weight_version=ns.weight_version)
    app = build_app(engine, token=token, host=ns.host)
    print(f"slipstream serve: {model_path} on http://{ns.host}:{ns.port}", file=sys.stderr, flush=True)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level, timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
