"""`slipstream serve --model PATH`: run the embedded inference server (engine + HTTP) in this process.

The model is loaded before the port is bound, so ``GET /health`` answering means the server can generate;
launchers (launch.py) wait for exactly that. Every field of :class:`EmbeddedServerConfig` is also a flag
(``--max-model-len 2048``, ``--kv-cache-tokens 65536`` ...), generated from the struct (its descriptions
are the ``--help`` text, cli_args.py) so the two never drift apart. The server binds loopback unless
``--host`` says otherwise.

Control and weight-update routes (pause, abort, weight pushes) need a token: the one in
``$SLIPSTREAM_SERVER_TOKEN`` (never a flag: the command line is visible to every user in ``ps``), else, on
loopback, a random one the server makes and prints once at start-up. Without it any local process could pause
the server, abort others' requests or install weights under a version so high that every real push is refused.
``--open`` runs without a token (loopback only, said at start-up); beyond loopback the server refuses to start
without ``$SLIPSTREAM_SERVER_TOKEN``.

Example::

    slipstream serve --model ~/.cache/slipstream/models/smollm2-135m-instruct --port 30000 --num-threads 2
    curl -s localhost:30000/generate -d '{"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 8}}'
"""

from __future__ import annotations

import argparse
import sys

import msgspec

from slipstream.cli_args import add_config_options, command_parser, config_values, doc_paragraph
from slipstream.config_base import validate
from slipstream.config_doc import sections
from slipstream.rollouter.config import EmbeddedServerConfig
from slipstream.utils.http_auth import TOKEN_ENV, check_bind, env_token, new_token
from slipstream.utils.net import LOOPBACK


def config_to_args(cfg: EmbeddedServerConfig) -> list[str]:
    """The flags that reproduce ``cfg`` on the command line (used by the launcher)."""
    args: list[str] = []
    for name, value in msgspec.structs.asdict(cfg).items():
        text = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        args += ["--" + name.replace("_", "-"), text]
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("slipstream serve", doc_paragraph(__doc__))
    # Hand-written: where this one process loads and binds, which no config field holds (a run places its
    # servers itself); every EmbeddedServerConfig field is generated below.
    parser.add_argument("--model", required=True, help="HF checkpoint directory or a known model name")
    parser.add_argument("--host", default=LOOPBACK, help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--weight-version", type=int, default=0, help="version stamped on tokens until an update"
    )
    parser.add_argument("--log-level", default="warning", help="uvicorn log level")
    parser.add_argument(
        "--open",
        action="store_true",
        help="no control token: pause, abort and weight updates open to every local process (loopback only; "
        f"default: ${TOKEN_ENV}, else a random token printed at start-up)",
    )
    add_config_options(
        parser,
        EmbeddedServerConfig,
        dashed=True,
        title="server config (rollout.embedded.* in a run's config)",
    )
    return parser


def parse_config(ns: argparse.Namespace) -> EmbeddedServerConfig:
    """The server config from the generated options given (each already checked against its field);
    ConfigError names the key when a cross-field rule refuses it."""
    keys = {row.key.replace(".", "_"): row.key for s in sections(EmbeddedServerConfig) for row in s.keys}
    return validate(config_values(ns, keys), EmbeddedServerConfig)


def control_token(ns: argparse.Namespace) -> str:
    """The token guarding control routes ("" with ``--open``): ``$SLIPSTREAM_SERVER_TOKEN``, else a random one,
    printed to stderr (the only place it is shown). ValueError for a combination that cannot run."""
    token = env_token()
    if ns.open and token:
        raise ValueError(f"--open and ${TOKEN_ENV} contradict each other: give one of them")
    check_bind(ns.host, token)
    if ns.open:
        print(
            "slipstream serve: --open: pause, abort and weight updates are open to every process on this "
            "machine",
            file=sys.stderr,
        )
        return ""
    if not token:
        token = new_token()
        print(
            f"slipstream serve: control token {token} (pause, abort and weight updates need "
            f"`Authorization: Bearer <token>`; set ${TOKEN_ENV} to choose it, or --open to run without one)",
            file=sys.stderr,
            flush=True,
        )
    return token


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        cfg = parse_config(ns)
    except (msgspec.ValidationError, ValueError) as err:
        print(f"slipstream serve: invalid option: {err}", file=sys.stderr)
        return 2
    try:  # before loading anything: a refused bind fails at once
        token = control_token(ns)
    except ValueError as err:
        print(f"slipstream serve: {err}", file=sys.stderr)
        return 2
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
