"""The train–inference mismatch figures (``slipstream/trainer/mismatch.py``): hand-computed values, masks
and versions, the quantile sample, the reduction over a real 2-rank gloo group, and a trainer step whose
behaviour logprobs were taken at another temperature than the trainer's, with and without a proximal
pass."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slipstream.queue.types import TrajectoryGroup
from slipstream.trainer.mismatch import MismatchCollector, token_mismatch
from slipstream.utils.net import free_port

KEYS = {
    "mismatch/k3",
    "mismatch/abs_diff_mean",
    "mismatch/abs_diff_max",
    "mismatch/ratio_p1",
    "mismatch/ratio_p50",
    "mismatch/ratio_p99",
    "mismatch/ratio_outside",
    "mismatch/measured_frac",
}
F64 = torch.float64


def test_identical_logprobs_measure_no_mismatch():
    logp = torch.tensor([-1.0, -2.5, -0.1, -7.0], dtype=torch.float32)
    got = token_mismatch(logp, logp.clone(), torch.tensor([1, 1, 0, 1]))
    assert got == {
        "mismatch/k3": 0.0,
        "mismatch/abs_diff_mean": 0.0,
        "mismatch/abs_diff_max": 0.0,
        "mismatch/ratio_p1": 1.0,
        "mismatch/ratio_p50": 1.0,
        "mismatch/ratio_p99": 1.0,
        "mismatch/ratio_outside": 0.0,
        "mismatch/measured_frac": 1.0,
    }


def test_hand_computed_figures_and_the_mask():
    trainer = torch.tensor([-1.0, -2.0, -0.5, -3.0], dtype=F64)
    # d = trainer - server = [-0.1, 0.3, 0.0] on the masked tokens; the unmasked one is far off and ignored
    server = trainer + torch.tensor([0.1, -0.3, 0.0, 5.0], dtype=F64)
    got = token_mismatch(trainer, server, torch.tensor([True, True, True, False]))
    r = [math.exp(-0.1), math.exp(0.3), 1.0]  # 0.904837, 1.349859, 1
    want = {
        "mismatch/k3": ((r[0] - 1 + 0.1) + (r[1] - 1 - 0.3) + 0.0) / 3,  # 0.0182320752
        "mismatch/abs_diff_mean": 0.4 / 3,
        "mismatch/abs_diff_max": 0.3,
        # sorted ratios [r0, 1, r1]; torch.quantile interpolates at position q * (n - 1)
        "mismatch/ratio_p1": r[0] + 0.02 * (1.0 - r[0]),  # 0.906740
        "mismatch/ratio_p50": 1.0,
        "mismatch/ratio_p99": 1.0 + 0.98 * (r[1] - 1.0),  # 1.342862
        "mismatch/ratio_outside": 1 / 3,  # 1.3499 > 1.25
        "mismatch/measured_frac": 1.0,
    }
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    assert got["mismatch/k3"] == pytest.approx(0.0182320752, rel=1e-9)


def test_exact_quantiles_and_the_ratio_band():
    ratios = torch.tensor([2.0, 0.5, 1.1, 1.0, 0.9, 0.8, 1.25], dtype=F64)
    got = token_mismatch(ratios.log(), torch.zeros(7, dtype=F64), torch.ones(7, dtype=torch.bool))
    # sorted: 0.5 0.8 0.9 1.0 1.1 1.25 2.0 (n - 1 = 6); the band's edges are inside it
    assert got["mismatch/ratio_p50"] == pytest.approx(1.0, rel=1e-12)
    assert got["mismatch/ratio_p1"] == pytest.approx(0.5 + 0.06 * 0.3, rel=1e-12)
    assert got["mismatch/ratio_p99"] == pytest.approx(1.25 + 0.94 * 0.75, rel=1e-12)
    assert got["mismatch/ratio_outside"] == pytest.approx(2 / 7, rel=1e-12)
    assert got["mismatch/abs_diff_max"] == pytest.approx(math.log(2.0), rel=1e-12)


def test_only_tokens_of_the_trainers_version_count():
    trainer = torch.zeros(6, dtype=F64)
    server = torch.tensor([0.0, 0.0, -1.0, -1.0, 0.0, -1.0], dtype=F64)  # d = 1 on the stale tokens
    mask = torch.tensor([0, 1, 1, 1, 1, 1])
    versions = torch.tensor([-1, 3, 2, 2, 3, 3])  # -1: prompt token
    c = MismatchCollector(version=3)
    c.add(trainer[:3], server[:3], mask[:3], versions[:3])  # two micro-batches of one step
    c.add(trainer[3:], server[3:], mask[3:], versions[3:])
    got = c.reduce()
    # counted: tokens 1, 4 (d = 0) and 5 (d = 1) of the five response tokens
    assert got["mismatch/measured_frac"] == pytest.approx(3 / 5)
    assert got["mismatch/abs_diff_mean"] == pytest.approx(1 / 3)
    assert got["mismatch/abs_diff_max"] == 1.0
    assert got["mismatch/k3"] == pytest.approx((math.e - 2) / 3)
    assert got["mismatch/ratio_outside"] == pytest.approx(1 / 3)

    none = MismatchCollector(version=4)
    none.add(trainer, server, mask, versions)
    assert none.reduce() == {"mismatch/measured_frac": 0.0}  # no token of version 4: nothing to measure
    assert MismatchCollector(version=0).reduce() == {"mismatch/measured_frac": 0.0}


def test_quantiles_come_from_a_bounded_systematic_sample():
    ratios = torch.arange(1, 13, dtype=F64) / 6  # 1/6 .. 2
    c = MismatchCollector(None, sample_per_rank=4)  # 12 values: every 3rd one, ratios 1/6, 4/6, 7/6, 10/6
    c.add(ratios.log(), torch.zeros(12, dtype=F64), torch.ones(12))
    got = c.reduce()
    assert got["mismatch/ratio_p50"] == pytest.approx(5.5 / 6, rel=1e-12)
    assert got["mismatch/ratio_p1"] == pytest.approx((1 + 0.03 * 3) / 6, rel=1e-12)
    assert got["mismatch/abs_diff_max"] == pytest.approx(math.log(6), rel=1e-12)  # exact, not sampled
    assert got["mismatch/ratio_outside"] == pytest.approx(9 / 12, rel=1e-12)  # exact, not sampled


def _rank_values(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    trainer, server = -torch.rand(9, generator=g, dtype=F64) * 3, -torch.rand(9, generator=g, dtype=F64) * 3
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0, 1, 1])
    return (trainer[:3], server[:3], mask[:3]) if rank == 0 else (trainer[3:], server[3:], mask[3:])


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        got, empty = MismatchCollector(None), MismatchCollector(None)
        got.add(*_rank_values(rank))
        if rank == 1:
            empty.add(*_rank_values(rank))  # rank 0 holds no token (a pipeline stage without a loss)
        figures = (got.reduce(world_size=2), empty.reduce(world_size=2))
        torch.save(figures, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_the_figures_over_two_ranks_equal_those_of_one_process(tmp_path):
    out = str(tmp_path / "figures")
    mp.start_processes(_worker, args=(free_port(), out), nprocs=2, start_method="spawn")
    parts = [_rank_values(r) for r in (0, 1)]
    whole = token_mismatch(*(torch.cat(x) for x in zip(*parts, strict=True)))
    rank1_alone = token_mismatch(*parts[1])
    for rank in (0, 1):
        both, one_empty = torch.load(f"{out}.{rank}")
        assert both.keys() == whole.keys() == KEYS
        for key in KEYS:
            assert both[key] == pytest.approx(whole[key], rel=1e-12), key
            assert one_empty[key] == pytest.approx(rank1_alone[key], rel=1e-12), key


def test_slipstream_plot_draws_the_figures(tmp_path):
    from slipstream.config import load_config
    from slipstream.metrics import MetricsLogger, read_metrics
    from slipstream.plot import PANELS, plot_run, series

    cfg = load_config(None, ["wandb.mode=disabled"])
    figures = token_mismatch(torch.tensor([-1.0, -2.0]), torch.tensor([-1.1, -1.5]), torch.ones(2))
    with MetricsLogger(tmp_path, cfg, total_steps=2) as log:
        log.log(1, {"trainer/reward_mean": 0.1, **figures})
        log.log(2, {"trainer/reward_mean": 0.2, "mismatch/measured_frac": 0.0})  # nothing measured: a gap
    records = read_metrics(tmp_path)
    size = series(records, PANELS["mismatch"][1])
    ratios = series(records, PANELS["mismatch_ratio"][1])
    assert set(size) == {
        "mismatch/k3",
        "mismatch/abs_diff_mean",
        "mismatch/abs_diff_max",
        "mismatch/ratio_outside",
    }
    assert set(ratios) == {"mismatch/ratio_p1", "mismatch/ratio_p50", "mismatch/ratio_p99"}
    assert size["mismatch/k3"] == ([1], [pytest.approx(figures["mismatch/k3"])])
    names = {p.name for p in plot_run(tmp_path)}
    assert {"mismatch.png", "mismatch_ratio.png", "summary.png"} <= names


# ---------------------------------------------------------------- a trainer step with a deliberate mismatch


def _with_server_logprobs(groups: list[TrajectoryGroup], model_path, temperature: float) -> list:
    """The groups with behaviour logprobs as a server sampling at ``temperature`` returns them:
    ``log_softmax(logits / temperature)[token]`` from the plain HF model in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    out = []
    for group in groups:
        trajs = []
        for t in group.to_trajectories():
            ids = torch.tensor(t.prompt_ids + t.response_ids)[None]
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0].float()
            p = len(t.prompt_ids)
            logp = torch.log_softmax(logits[p - 1 : -1] / temperature, dim=-1)
            tok = torch.tensor(t.response_ids)[:, None]
            trajs.append(msgspec.structs.replace(t, logprobs=logp.gather(-1, tok)[:, 0].tolist()))
        out.append(TrajectoryGroup.from_trajectories(trajs))
    return out


def _groups() -> list[TrajectoryGroup]:
    from tests.trainer.fake_queue import make_group

    return [make_group(f"g{i}", 4, version=0, seed=i) for i in range(2)]


def _flat_logprobs(groups: list[TrajectoryGroup]) -> torch.Tensor:
    return torch.tensor([x for g in groups for t in g.to_trajectories() for x in t.logprobs], dtype=F64)


def _first_step_figures(model_path, server_temperature: float, *overrides: str) -> dict[str, float]:
    from slipstream.trainer.engine import make_aux_engines
    from slipstream.trainer.engine.fsdp import FSDPEngine
    from slipstream.trainer.trainer import Trainer
    from tests.trainer.conftest import trainer_settings
    from tests.trainer.fake_queue import FakeQueue, collate

    cfg = trainer_settings(
        model_path, "trainer.batch_groups=2", "rollout.sampling.temperature=1.0", *overrides
    )
    queue = FakeQueue()
    for group in _with_server_logprobs(_groups(), model_path, server_temperature):
        queue.put(group)
    engine = FSDPEngine(cfg)
    engine.initialize()
    trainer = Trainer(cfg, engine, queue, rank=0, world_size=1, collate_fn=collate, **make_aux_engines(cfg))
    metrics = trainer.step()
    return {k: v for k, v in metrics.items() if k.startswith("mismatch/")}


@pytest.mark.parametrize(
    "overrides",
    [[], ["trainer.algorithm.policy_loss=decoupled_ppo"]],
    ids=["first-update", "proximal-pass"],
)
def test_a_server_sampling_at_another_temperature_moves_the_figures(
    tiny_model_path, single_process_group, overrides
):
    same = _first_step_figures(tiny_model_path, 1.0, *overrides)
    assert same.keys() == KEYS
    # the trainer's chunked fp32 path against the plain HF forward: equal to float rounding
    assert same["mismatch/k3"] < 1e-10
    assert same["mismatch/abs_diff_max"] < 1e-4
    assert same["mismatch/ratio_outside"] == 0.0
    for q in ("p1", "p50", "p99"):
        assert same[f"mismatch/ratio_{q}"] == pytest.approx(1.0, abs=1e-4)
    assert same["mismatch/measured_frac"] == 1.0

    hot = _first_step_figures(tiny_model_path, 0.5, *overrides)
    # what the trainer measured is what the pure function gives for T = 1 against T = 0.5 ...
    at_1 = _flat_logprobs(_with_server_logprobs(_groups(), tiny_model_path, 1.0))
    at_05 = _flat_logprobs(_with_server_logprobs(_groups(), tiny_model_path, 0.5))
    ref = token_mismatch(at_1, at_05, torch.ones(at_1.numel(), dtype=torch.bool))
    for key in KEYS:
        assert hot[key] == pytest.approx(ref[key], rel=1e-3, abs=1e-6), key
    # ... and far from the matching run's (the random tiny model's next-token distributions are nearly flat,
    # so halving the temperature moves them less than it would a trained model's: k3 0.0116, 8 of 37 tokens
    # outside the band, ratio p1 0.70 and p99 1.28)
    assert hot["mismatch/k3"] > 0.01
    assert hot["mismatch/abs_diff_mean"] > 0.1
    assert hot["mismatch/ratio_outside"] > 0.2
    assert hot["mismatch/ratio_p1"] < 0.75 and hot["mismatch/ratio_p99"] > 1.25
    assert hot["mismatch/measured_frac"] == 1.0
