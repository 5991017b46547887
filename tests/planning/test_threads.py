"""The CPU split: compute threads per part planned from the machine's cores, and a warning naming the keys
when the parts ask for more than there are."""

from __future__ import annotations

from slipstream.config import load_config
from slipstream.pipeline.modes import config_warnings, prepare_config
from slipstream.planning.threads import plan_threads

QUICKSTART = "configs/quickstart.yaml"


def test_the_quickstart_splits_two_cores_one_for_the_server_one_for_the_trainer():
    plan = plan_threads(load_config(QUICKSTART), cores=2)
    assert [(s.threads, s.key) for s in plan.shares] == [
        (1, "rollout.vllm.cpu_threads"),
        (1, "cluster.trainer_threads"),
    ]
    assert plan.trainer_threads == 1 and plan.warnings() == []


def test_more_threads_than_cores_is_a_warning_naming_every_key():
    cfg = load_config(QUICKSTART, ["cluster.trainer_threads=2"])
    (warning,) = plan_threads(cfg, cores=2).warnings()
    assert "3 compute threads on 2 cores" in warning
    assert "rollout.vllm.cpu_threads" in warning and "cluster.trainer_threads" in warning
    # config_warnings (what the run logs and `slipstream config check` prints) uses this machine's cores
    assert bool(config_warnings(load_config(QUICKSTART, ["cluster.trainer_threads=64"])))


def test_zero_takes_what_the_other_parts_leave():
    embedded = load_config(QUICKSTART, ["rollout.backend=embedded", "rollout.embedded.num_threads=3"])
    assert plan_threads(embedded, cores=8).trainer_threads == 5
    two_ranks = load_config(QUICKSTART, ["rollout.backend=embedded", "rollout.embedded.num_threads=2",
                                         "trainer.num_ranks=2"])  # fmt: skip
    assert plan_threads(two_ranks, cores=8).trainer_threads == 3
    all_cores = load_config(QUICKSTART, ["rollout.backend=embedded", "rollout.embedded.num_threads=0"])
    plan = plan_threads(all_cores, cores=4)
    assert plan.shares[0].threads == 4 and plan.trainer_threads == 1  # at least one thread each
    assert plan.warnings()  # 5 on 4


def test_parts_elsewhere_do_not_compete():
    given = load_config(QUICKSTART, ["rollout.server_urls=[http://127.0.0.1:30000]"])
    assert [s.key for s in plan_threads(given, cores=2).shares] == ["cluster.trainer_threads"]
    cluster = load_config(QUICKSTART, ["cluster.ray_address=auto", "cluster.trainer_threads=8"])
    assert plan_threads(cluster, cores=2).warnings() == []


def test_sync_mode_alternates_so_each_part_may_take_every_core():
    sync = load_config(
        QUICKSTART, ["async.mode=sync", "rollout.vllm.cpu_threads=2", "cluster.trainer_threads=0"]
    )
    plan = plan_threads(sync, cores=2)
    assert plan.trainer_threads == 2 and plan.warnings() == []
    (warning,) = plan_threads(
        load_config(QUICKSTART, ["async.mode=sync", "cluster.trainer_threads=3"]), 2
    ).warnings()
    assert "trainer rank 0 3 (cluster.trainer_threads)" in warning and "vLLM" not in warning


def test_an_in_place_push_on_sglang_is_a_warning_that_its_cache_outlives_the_push():
    def warnings(*overrides: str) -> list[str]:
        cfg, _ = prepare_config(load_config(QUICKSTART, ["cluster.trainer_threads=1", *overrides]))
        return [w for w in config_warnings(cfg) if "radix cache" in w]

    (warning,) = warnings("rollout.backend=sglang", "async.partial_rollout=in_place")
    assert warning.startswith("async.partial_rollout: `in_place` on SGLang")
    assert warnings("rollout.backend=sglang", "async.partial_rollout=abort") == []
    assert warnings("async.partial_rollout=in_place") == []  # vLLM clears its cache at every pause
