"""``slipstream bench multimodal``: vision-language RL measured end to end on a tiny random Qwen2-VL.

It writes a tiny random Qwen2-VL (fp32; ``utils/tiny_vlm.py``) and ``shapes`` prompts (``slipstream data
make shapes``: 112 x 112 PNGs, 16 image tokens each), and reports:

* ``vlm_logprob_max_abs_err``: real vLLM (its CPU build, fp32, the native route) samples ``--prompts``
  image prompts at temperature 1; the FSDP engine scores vLLM's sampled tokens given vLLM's expanded prompt
  ids and the same encoded images through the model's own image processor; the largest difference from
  vLLM's logprobs (goal 1e-4);
* ``image_bytes_per_group`` against ``image_bytes_per_sample_naive``: the bytes a group of ``--n``
  samples of one image prompt carries for its images through the queue (its ``images`` column, once per
  group) and what one copy per sample would carry; ``image_ratio`` is their ratio (goal 1/n);
  ``pixel_bytes_per_image`` is what the model's fp32 ``pixel_values`` of one image would weigh instead;
* ``steps_completed``: trainer steps of a short fully asynchronous pipeline run on those prompts (the
  quickstart's layout, vLLM and the trainer on one core each, a push every step; goal 3), with its mean
  reward and the pushes the server applied (``pushes_applied``) and refused (``pushes_failed``).

    slipstream bench multimodal --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from slipstream.cli_args import add_json_flag, command_parser, doc_paragraph

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"
MAX_MODEL_LEN = 1024


def _parser() -> argparse.ArgumentParser:
    p = command_parser("slipstream bench multimodal", doc_paragraph(__doc__))
    p.add_argument("--prompts", type=int, default=6, help="image prompts sampled for the logprob comparison")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens sampled per prompt")
    p.add_argument("--n", type=int, default=8, help="samples per group for the image bytes")
    p.add_argument("--steps", type=int, default=3, help="trainer steps of the pipeline run (0: no run)")
    add_json_flag(p)
    return p


def serve(model: Path, log: Path):  # noqa: ANN201
    """A vLLM server (fp32, the native route) of ``model``, healthy; the caller stops it."""
    from slipstream.rollouter.config import RolloutConfig, VLLMServerConfig
    from slipstream.rollouter.launch import launch_server
    from slipstream.serverkinds import server_kind

    v = VLLMServerConfig(dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=16, cpu_kv_cache_gib=1)
    server = launch_server(
        server_kind("vllm"), model, cfg=RolloutConfig(backend="vllm", vllm=v), log_path=log
    )
    server.wait_healthy(600)
    return server


def sampled_batch(url: str, model: Path, rows: list[dict], max_new_tokens: int) -> tuple[Any, Any]:
    """vLLM's samples of ``rows`` (temperature 1) as a packed batch with its images, and vLLM's logprobs
    aligned with the batch's tokens (0 on prompts)."""
    import httpx
    from transformers import AutoTokenizer

    from slipstream.agents.multimodal import ImageLimits, content_parts, decode_image

    tok = AutoTokenizer.from_pretrained(model)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    replies = []
    for i, row in enumerate(rows):
        imgs = [decode_image(item["bytes"], limits=ImageLimits()) for item in row["images"]]
        chat = tok.apply_chat_template(row["prompt"], add_generation_prompt=True)
        body = {
            "token_ids": list(chat["input_ids"] if hasattr(chat, "keys") else chat),
            "content_parts": content_parts(imgs),
            "sampling_params": {"max_tokens": max_new_tokens, "temperature": 1.0, "logprobs": 0, "seed": i},
            "return_token_ids": True,
        }
        reply = httpx.post(url + "/inference/v1/generate", json=body, timeout=300)
        reply.raise_for_status()
        out = reply.json()
        # the engine refuses a generated pad; a random model may sample one
        if pad in out["choices"][0]["token_ids"]:
            continue
        replies.append((out, imgs))
    return packed_replies(replies, str(model))


def packed_replies(replies: list[tuple[dict, list]], model: str) -> tuple[Any, Any]:
    """vLLM native-route replies (each with its prompt's images) packed into one batch the FSDP engine scores,
    and vLLM's logprobs aligned with the batch's tokens (0 on prompts)."""
    import torch
    from tensordict import TensorDict

    from slipstream.trainer.engine.vision import ImageProcessor

    ids, pos, mask, cu, prompt_lens, served, images = [], [], [], [0], [], [], []
    for out, imgs in replies:
        prompt, response = out["prompt_token_ids"], out["choices"][0]["token_ids"]
        ids += prompt + response
        pos += list(range(len(prompt) + len(response)))
        mask += [0] * len(prompt) + [1] * len(response)
        cu.append(len(ids))
        prompt_lens.append(len(prompt))
        served += [0.0] * len(prompt) + [e["logprob"] for e in out["choices"][0]["logprobs"]["content"]]
        images.append([im.data for im in imgs])
    batch = TensorDict(
        {
            "input_ids": torch.tensor(ids),
            "position_ids": torch.tensor(pos),
            "loss_mask": torch.tensor(mask),
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
            "prompt_lens": torch.tensor(prompt_lens),
            **ImageProcessor(model)(images),
        },
        batch_size=[],
    )
    return batch, torch.tensor(served)


def trainer_logprobs(model: Path, batch: Any) -> Any:
    """The FSDP engine's logprobs of ``batch`` (one process, fp32)."""
    import torch.distributed as dist

    from slipstream.config import load_config, trainer_settings
    from slipstream.trainer.engine.fsdp import FSDPEngine

    cfg = load_config(None, [f"model.path={model}", "trainer.device=cpu", "trainer.micro_batch_tokens=4096"])
    engine = FSDPEngine(trainer_settings(cfg))
    try:
        engine.initialize()
        return engine.forward_backward_batch(batch, None, forward_only=True).tokens["logprobs"]
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def logprob_error(model: Path, rows: list[dict], max_new_tokens: int, log: Path) -> dict[str, float]:
    server = serve(model, log)
    try:
        batch, served = sampled_batch(server.url, model, rows, max_new_tokens)
    finally:
        server.stop()
    got = trainer_logprobs(model, batch)
    scored = batch["loss_mask"].bool()
    return {
        "vlm_logprob_max_abs_err": float((got[scored] - served[scored]).abs().max()),
        "vlm_scored_tokens": int(scored.sum()),
        "vlm_samples": int(batch["cu_seqlens"].numel() - 1),
    }


def image_bytes(model: Path, row: dict, n: int) -> dict[str, float]:
    """A group of ``n`` samples of ``row`` (one image) as the rollouter builds it, against per-sample copies."""
    from slipstream.queue.testing import make_group
    from slipstream.queue.types import IMAGE_COLUMN, TrajectoryGroup
    from slipstream.trainer.engine.vision import ImageProcessor

    data = [item["bytes"] for item in row["images"]]
    text = make_group("g", n=n, prompt_len=40, response_len=16)
    group = TrajectoryGroup.from_trajectories(text.to_trajectories(), images=data)
    per_group = int(group.tensors[IMAGE_COLUMN].numel())
    naive = n * sum(len(d) for d in data)
    pixels = ImageProcessor(str(model))([data])["pixel_values"]
    return {
        "image_bytes_per_group": per_group,
        "image_bytes_per_sample_naive": naive,
        "image_ratio": round(per_group / naive, 4),
        "group_bytes": group.nbytes,
        "pixel_bytes_per_image": pixels.numel() * pixels.element_size(),
        "n": n,
    }


def pipeline_records(model: Path, data: Path, out: Path, steps: int, *overrides: str) -> list[dict[str, Any]]:
    """The metrics records of a short fully asynchronous run on the image prompts (the quickstart's layout:
    vLLM and the trainer, one core each, a push every step), one per step; ``overrides`` are dotted keys
    applied last (the vLLM test runs it in fp32 and in sync mode, with the tower frozen)."""
    from slipstream.config import load_config
    from slipstream.metrics import read_metrics
    from slipstream.pipeline import Pipeline

    keys = [
        f"model.path={model}",
        f"data.train_files=[{data}]",
        "data.val_files=[]",
        "eval.every=0",
        f"run.total_steps={steps}",
        f"run.output_dir={out}",
        "run.name=multimodal",
        "run.resume=false",
        "rollout.n=4",
        "trainer.batch_groups=2",
        f"rollout.vllm.max_model_len={MAX_MODEL_LEN}",
        "wandb.mode=disabled",
        *overrides,
    ]
    result = Pipeline(load_config(QUICKSTART, keys)).run()
    return read_metrics(result.run_dir)


def pipeline_run(model: Path, data: Path, out: Path, steps: int) -> dict[str, Any]:
    """The bench's summary of :func:`pipeline_records`."""
    t0 = time.monotonic()
    records = pipeline_records(model, data, out, steps)
    rewards = [r.get("trainer/reward_mean", 0.0) for r in records]
    return {
        "steps_completed": len(records),
        "reward_mean": round(sum(rewards) / max(1, len(rewards)), 4),
        "versions": [r.get("trainer/version") for r in records],
        # servers that applied each push, and that refused or missed it
        "pushes_applied": int(sum(r.get("sync/servers_ok", 0.0) for r in records)),
        "pushes_failed": int(sum(r.get("sync/servers_failed", 0.0) for r in records)),
        "pipeline_s": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from slipstream.agents.datagen import make_rows, write_rows
    from slipstream.utils.tiny_vlm import make_tiny_qwen2_vl

    with tempfile.TemporaryDirectory(prefix="slipstream-bench-mm-") as tmp:
        root = Path(tmp)
        model = make_tiny_qwen2_vl(root / "qwen2-vl", max_position_embeddings=MAX_MODEL_LEN)
        rows = make_rows("shapes", max(args.prompts, 64), seed=0)
        result: dict[str, Any] = {}
        result.update(logprob_error(model, rows[: args.prompts], args.max_new_tokens, root / "vllm.log"))
        print(f"logprobs: {json.dumps(result)}", file=sys.stderr, flush=True)
        result.update(image_bytes(model, rows[0], args.n))
        if args.steps > 0:
            data = root / "shapes.parquet"
            write_rows(rows, data)
            result.update(pipeline_run(model, data, root / "runs", args.steps))
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:32s} {value}")
    return 0
