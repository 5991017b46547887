"""``slipstream bench boundary``: the train–inference boundary checked on a real vLLM server, in one run.

It writes a tiny random Llama (fp32, its output layer scaled so that top-p 0.8 cuts: ``--sharpen``), starts
vLLM (its CPU build here) on loopback with a run token, and holds the trainer's side (the same checkpoint in
transformers, moved a little per version) against what vLLM serves:

* ``stale_cache_max_err``: a 400-token prompt cached before a push (``in_place``), generated again after it:
  the largest |vLLM - trainer| logprob at the new version (the cache must not outlive the push; goal 1e-4);
* ``partial_whole_version_refused``: a whole version missing one tensor is refused and the old one serves;
* ``corrupt_push_refused``: a version with one byte flipped after the trainer digested it is refused
  (``weightsync.verify``) and the old one serves;
* ``verify_overhead``: pushes with the digests over pushes without, less one (medians, interleaved; on this
  tiny model the calls dominate: ``bench weightsync --target vllm`` measures it on the quickstart's model);
* ``mask_replay_max_err``: at top-k 20 and top-p 0.8, the largest |vLLM's processed logprob - the trainer's
  with the filter replayed| (``trainer/logprobs.py``; goal 1e-4), and ``no_mask_replay_max_err`` the same
  without the replay (it must be large, or the check shows nothing);
* ``unauthenticated_state_changes``: state-changing routes (and path tricks on ``/pause``) that answered
  without the token (goal 0), and whether vLLM then reported itself paused.

    slipstream bench boundary --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from slipstream.cli_args import add_json_flag, command_parser, doc_paragraph
from slipstream.weightsync.buckets import BucketPacker, PackedBucket

TOKEN = "bench-boundary-token"
LONG_PROMPT = [3 + (i * 37) % 240 for i in range(400)]  # three whole KV blocks of the CPU build, and more
PROMPTS = [[5, 17, 99, 3, 250, 42, 7, 8], [11, 12, 13], [40, 41, 42, 43, 44]]
STATE_ROUTES = [
    "/pause", "/resume", "/abort_requests", "/inference/v1/abort_requests", "/reset_prefix_cache",
    "/collective_rpc", "/sleep", "/wake_up", "/init_weight_transfer_engine", "/start_weight_update",
    "/update_weights", "/finish_weight_update", "/shutdown_weight_transfer_engine", "/scale_elastic_ep",
    "/v1/load_lora_adapter", "/start_profile",
]  # fmt: skip
PAUSE_TRICKS = [
    "//pause",
    "/pause/",
    "/%70ause",
    "/./pause",
    "/health/../pause",
    "/health%2F..%2Fpause",
    "/PAUSE",
]


class CorruptOnce:
    """Flips one byte of the first packed tensor of ``version``'s first bucket after the sender digested it
    (bytes changed on the way); only that bucket. ``name``: the tensor hit, once it was."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.name: str | None = None

    def wrap(self, close: Callable[..., PackedBucket]) -> Callable[..., PackedBucket]:
        def corrupting(packer: BucketPacker, bucket: Any, last: bool) -> PackedBucket:
            packed = close(packer, bucket, last)
            if packer.version == self.version and self.name is None:
                runs = [(o, n) for o, n, d in bucket.segments if d is None]
                for entry in packed.meta.entries:
                    if entry.nbytes and any(o <= entry.offset < o + n for o, n in runs):
                        packer.pool.buffer(packed.slot)[entry.offset] ^= 0x40
                        self.name = entry.name
                        break
            return packed

        return corrupting

    def __enter__(self) -> CorruptOnce:
        self._close = BucketPacker._close
        BucketPacker._close = self.wrap(self._close)  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        BucketPacker._close = self._close  # type: ignore[method-assign]


class Trainer:
    """The trainer's side: the checkpoint in transformers, fp32, moved a little for each version."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def step(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.002)

    def tensors(self, drop: str = "") -> Iterator[tuple[str, torch.Tensor]]:
        return ((n, p.detach().clone()) for n, p in self.model.named_parameters() if n != drop)

    def logprobs(
        self, prompt: list[int], output: list[int], top_k: int = -1, top_p: float = 1.0
    ) -> torch.Tensor:
        from slipstream.trainer.logprobs import full_token_logprobs, sampling_truncation

        ids = torch.tensor([prompt + output])
        with torch.no_grad():
            hidden = self.model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1 : -1]
            weight = self.model.get_output_embeddings().weight
            trunc = sampling_truncation(1.0, top_k, top_p)
            logp, _ = full_token_logprobs(
                hidden, weight, torch.tensor(output), temperature=1.0, truncation=trunc
            )
        return logp


def _parser() -> argparse.ArgumentParser:
    p = command_parser("slipstream bench boundary", doc_paragraph(__doc__))
    p.add_argument("--sharpen", type=float, default=20.0, help="scale of the tiny model's output layer")
    p.add_argument("--reps", type=int, default=3, help="pushes with and without verification, each")
    p.add_argument("--log", default="", help="vLLM's log file (default: a temporary file)")
    add_json_flag(p)
    return p


def _model(root: Path, sharpen: float) -> Path:
    from transformers import AutoModelForCausalLM

    from slipstream.utils.tiny_models import make_tiny_model

    path = make_tiny_model(
        root / "model", hidden_size=64, num_heads=2, num_kv_heads=1, max_position_embeddings=1024
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(sharpen)
    model.save_pretrained(path)
    return path


def _generate(url: str, prompt: list[int], n: int, top_k: int = -1, top_p: float = 1.0):
    from slipstream.agents.protocol import SamplingParams
    from slipstream.serverkinds.vllm import VLLMClient

    async def go():
        client = VLLMClient(url, api="generate", timeout_s=300).authorize(TOKEN)
        params = SamplingParams(max_new_tokens=n, temperature=1.0, top_k=top_k, top_p=top_p, ignore_eos=True)
        try:
            return await client.generate(prompt, params)
        finally:
            await client.aclose()

    return asyncio.run(go())


def _max_err(a: torch.Tensor, b: list[float]) -> float:
    return (a - torch.tensor(b, dtype=torch.float32)).abs().max().item()


def _unauthenticated(url: str) -> tuple[int, bool]:
    """State-changing calls answered without the token, and whether vLLM says it is paused afterwards."""
    import httpx

    answered = 0
    with httpx.Client(base_url=url, timeout=30) as http:
        for path in STATE_ROUTES + PAUSE_TRICKS:
            reply = http.post(path, json={})
            answered += reply.status_code < 400
        paused = http.get("/is_paused", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    return answered, bool(paused.get("is_paused"))


def main(argv: list[str]) -> int:
    from slipstream.rollouter.clients.base import parse_version
    from slipstream.rollouter.config import RolloutConfig, VLLMServerConfig
    from slipstream.rollouter.launch import launch_server
    from slipstream.serverkinds import server_kind
    from slipstream.utils.http_auth import TOKEN_ENV
    from slipstream.weightsync.config import WeightSyncConfig
    from slipstream.weightsync.publisher import WeightPublisher

    args = _parser().parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="slipstream-boundary-"))
    path = _model(root, args.sharpen)
    trainer = Trainer(path)
    v = VLLMServerConfig(dtype="float32", max_model_len=1024, max_num_seqs=8, cpu_kv_cache_gib=1)
    log = Path(args.log) if args.log else root / "vllm.log"
    cfg = WeightSyncConfig(backend="torch_dist", bucket_mb=1, timeout_s=60, device="cpu", keep_last=False)
    out: dict[str, Any] = {}
    with launch_server(server_kind("vllm"), path, cfg=RolloutConfig(backend="vllm", vllm=v), log_path=log,
                       env={TOKEN_ENV: TOKEN}) as server:  # fmt: skip
        server.wait_healthy(900)
        url = server.url
        out["unauthenticated_state_changes"], out["paused_without_token"] = _unauthenticated(url)
        pub = WeightPublisher(cfg, [url], server_kind("vllm"), token=TOKEN)

        def push(version: int, tensors: Iterator, mode: str = "in_place") -> Any:
            cfg.pause_mode = mode
            return pub.publish(version, tensors)

        def serving() -> int:
            import httpx

            auth = {"Authorization": f"Bearer {TOKEN}"}
            return parse_version(
                httpx.get(f"{url}/weight_info", headers=auth, timeout=10).json()["weight_version"]
            )

        try:
            push(1, trainer.tensors())
            _generate(url, LONG_PROMPT, 4)  # the prompt's blocks are now in vLLM's prefix cache
            trainer.step(seed=1)
            push(2, trainer.tensors())
            after = _generate(url, LONG_PROMPT, 8)
            out["stale_cache_max_err"] = _max_err(
                trainer.logprobs(LONG_PROMPT, after.output_ids), after.logprobs
            )

            pub.whole_names.names = None  # vLLM's own receiver is what this checks, not the publisher's names
            partial = push(3, trainer.tensors(drop="model.layers.0.mlp.down_proj.weight"))
            out["partial_whole_version_refused"] = bool(partial.failed) and serving() == 2
            with CorruptOnce(4) as corrupt:
                report = push(4, trainer.tensors())
            out["corrupt_push_refused"] = corrupt.name is not None and bool(report.failed) and serving() == 2

            timings: dict[bool, list[float]] = {True: [], False: []}
            for i in range(2 * args.reps):
                cfg.verify = i % 2 == 0
                start = time.perf_counter()
                push(5 + i, trainer.tensors())
                timings[cfg.verify].append(time.perf_counter() - start)
            cfg.verify = True
            out["verify_overhead"] = statistics.median(timings[True]) / statistics.median(timings[False]) - 1

            replay, no_replay = [], []
            for prompt in PROMPTS:
                o = _generate(url, prompt, 32, top_k=20, top_p=0.8)
                replay.append(_max_err(trainer.logprobs(prompt, o.output_ids, 20, 0.8), o.logprobs))
                no_replay.append(_max_err(trainer.logprobs(prompt, o.output_ids), o.logprobs))
            out["mask_replay_max_err"], out["no_mask_replay_max_err"] = max(replay), max(no_replay)
        finally:
            pub.close()
    out = {k: round(v, 7) if isinstance(v, float) else v for k, v in out.items()}
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            print(f"{key:>32}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
