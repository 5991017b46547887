"""Judge servers the pipeline starts (``reward.service.launch``), across real processes on tiny models.

The judge is the tiny model's architecture with hand-set weights (:func:`make_grading_judge`): every layer's
output projections are zero, so each next token depends on the last one only, and its output layer maps
that chain to ``Score: 1`` then end-of-turn, after any chat prompt. Every sample therefore gets a valid score
of 1.0 from the launched judge, end to end: the trainer's mean reward is 1.0 and no reward error is
recorded (at step 1, and at step 3 from the restarted judge; step 2's samples may be scored while it is down). That the judge still serves weight version 0 while the rollout server serves the trainer's proves
no push reached it. The judge is killed after step 1: it comes back on a new port, and the scores of later
steps (and the tokens the new process generates) prove the reward service was handed its new URL.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import httpx
import pytest

from slipstream.config import ConfigError
from slipstream.pipeline import Pipeline
from slipstream.pipeline.modes import check_config, prepare_config
from slipstream.pipeline.placement import format_layout, plan
from tests.pipeline.conftest import pipeline_config

FAILURE_SCORE = -0.5
VERDICT = "Score: 1"


def make_grading_judge(tiny_model_path, out_dir):
    """A checkpoint of the tiny model's shape whose reply to any chat prompt is ``Score: 1`` (greedy or not):
    attention and MLP outputs are zeroed, so the last layer's state is the current token's embedding, and the
    output layer scores the token that follows it in the chain ``\\n S c o r e : ' ' 1 <|im_end|>`` (the
    chat template's generation prompt ends with a newline)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    chain = [tok.encode(c, add_special_tokens=False) for c in ["\n", *VERDICT]]
    assert all(len(ids) == 1 for ids in chain), chain  # the byte-level tokenizer: a token per character
    chain = [ids[0] for ids in chain] + [tok.convert_tokens_to_ids("<|im_end|>")]
    assert len(set(chain)) == len(chain)  # each token has one successor
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        emb = model.model.embed_tokens.weight
        unit = emb / emb.norm(dim=-1, keepdim=True)
        head = torch.zeros_like(model.lm_head.weight)
        for prev, nxt in zip(chain, [*chain[1:], chain[-1]], strict=True):
            head[nxt] += 60.0 * unit[prev] * emb.shape[1] ** 0.5
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (tiny_model_path / name).exists():
            shutil.copy(tiny_model_path / name, out_dir / name)
    return out_dir


def model_info(url: str) -> dict:
    return httpx.get(f"{url}/model_info", timeout=10).json()


def test_the_grading_judge_says_score_1_after_any_chat_prompt(tiny_model_path, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    judge = make_grading_judge(tiny_model_path, tmp_path / "judge")
    tok = AutoTokenizer.from_pretrained(judge)
    model = AutoModelForCausalLM.from_pretrained(judge, dtype=torch.float32)
    for question in ("What is 2 + 3?", "Grade this.\n\nResponse:\n7"):
        text = tok.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
        out = model.generate(ids, max_new_tokens=12, do_sample=True, temperature=1.0)
        assert tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True) == VERDICT


def test_a_judge_pool_started_by_the_pipeline_scores_and_never_takes_a_push(
    ray_pools, tiny_model_path, tmp_path
):
    judge = make_grading_judge(tiny_model_path, tmp_path / "judge")
    cfg = pipeline_config(
        tmp_path, tiny_model_path, "async.mode=sync", "run.total_steps=3",
        "reward.sources={arithmetic: service}",
        f"reward.service.launch.model_path={judge}",
        "reward.service.judge_max_tokens=12",
        "reward.service.retries=1",
        "reward.service.backoff_s=0.05",
        "reward.service.timeout_s=30",
        "reward.timeout_s=60",
        f"reward.service.failure_score={FAILURE_SCORE}",
        prompts=6,
    )  # fmt: skip
    assert [p.name for p in plan(cfg)[1] if p.group == "rollout"] == ["server0", "judge0"]
    seen: list[tuple[int, dict, dict]] = []

    judge_urls: list[str] = []

    def on_step(pipeline, version, metrics):
        if version != 2:  # step 2's samples may have been scored while the judge was dead (killed below)
            assert metrics["trainer/reward_mean"] == 1.0, metrics  # every sample: the judge's verdict
            assert metrics.get("rollouter/reward_errors", 0.0) == 0.0, metrics
        parts = pipeline.parts
        judge, server = parts.judges.urls, parts.servers.urls
        assert len(judge) == 1 and judge[0] not in server
        seen.append((version, model_info(server[0]), model_info(judge[0])))
        judge_urls.append(judge[0])
        if version == 1:  # reserved in the rollout pool, as `--check-placement` prints it
            layout = pipeline.placement.layout()
            assert [(s.part, s.pool) for s in layout if s.pool == "rollout"][:2] == [
                ("server0", "rollout"),
                ("judge0", "rollout"),
            ]
            assert re.search(r"^judge0 +rollout ", format_layout(layout), re.MULTILINE)
            os.kill(parts.judges.hosts()[0].pid(), signal.SIGKILL)
            deadline = time.monotonic() + 120
            while not pipeline.restarts.get("judge-0") or pipeline.supervisor.judges.restarting:
                assert time.monotonic() < deadline, "the judge server did not come back"
                pipeline.poll_parts()
                time.sleep(0.2)

    result = Pipeline(cfg, on_step=on_step).run()
    assert result.version == 3 and result.restarts == {"judge-0": 1}
    assert [v for v, _, _ in seen] == [1, 2, 3]
    for version, server, judge in seen:
        assert server["weight_version"] == str(version)  # the rollout server took every push
        assert judge["weight_version"] == "0"  # the judge took none
    assert seen[0][2]["generated_tokens"] > 0  # the reward service's requests reached the judge
    assert judge_urls[0] != judge_urls[1] == judge_urls[2]  # restarted on a new port
    assert seen[2][2]["generated_tokens"] > 0  # ... and the reward service calls it there
    records = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3
    for rec in (records[0], records[2]):  # before the kill, and from the restarted judge: all valid verdicts
        assert rec["trainer/reward_mean"] == 1.0, rec
        assert rec.get("rollouter/reward_errors", 0.0) == 0.0, rec
    logs = result.run_dir / "logs"
    assert (logs / "judge-embedded-0.log").is_file() and (logs / "judge-0.log").is_file()
    assert "malformed judge reply" not in (logs / "rollouter.log").read_text()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["reward.service.launch.model_path=/nonexistent/judge"], "reward.service.launch.model_path: `"),
        (
            ["reward.service.launch.backend=sglang", "reward.service.launch.gpus_per_server=0"],
            "reward.service.launch.",  # not installed here, or (where it is) no GPUs
        ),
        (
            ["reward.service.urls=[http://127.0.0.1:1]"],
            "reward.service.urls, reward.service.launch.model_path: both set",
        ),
    ],
)
def test_a_judge_pool_that_cannot_start_fails_the_config_check(tiny_model_path, tmp_path, overrides, message):
    cfg = pipeline_config(
        tmp_path, tiny_model_path, "reward.sources={arithmetic: service}",
        f"reward.service.launch.model_path={tiny_model_path}", *overrides,
    )  # fmt: skip
    with pytest.raises(ConfigError) as err:
        check_config(prepare_config(cfg)[0])
    assert str(err.value).startswith(message), str(err.value)
