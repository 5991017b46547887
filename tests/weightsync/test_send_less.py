"""Delta and LoRA adapter-only versions through the real publisher to serving processes on loopback.

The dict-backed servers (wsync_target_server.py) report a digest of what they serve, so every check is
bit for bit: a server that received a delta, or adapters alone, serves exactly the tensors a whole push of
the same version gives. The guards: a delta to a server that lost its base (restarted), adapters alone to
a server without the base weights, and an adapter whose shapes do not fit, are each refused by name,
and the server never serves a mix.
"""

from __future__ import annotations

import pytest
import torch
from wsync_helpers import TargetServers, digest, mixed_tensors, served, status
from wsync_target_server import serve

from slipstream.serverkinds import server_kind
from slipstream.weightsync.config import WeightSyncConfig
from slipstream.weightsync.delta import merge_lora
from slipstream.weightsync.publisher import WeightPublisher, publish_lora

TIMEOUT_S = (
    60.0  # a bound no healthy push reaches: nobody dies mid-push here (a restart kills an idle server)
)


def config(**kw) -> WeightSyncConfig:
    return WeightSyncConfig(
        backend=kw.pop("backend", "torch_dist"), bucket_mb=1, timeout_s=TIMEOUT_S, device="cpu", **kw
    )


@pytest.fixture
def servers():
    s = TargetServers(serve)
    yield s
    s.stop()


def nudged(base: list[tuple[str, torch.Tensor]], step: int) -> list[tuple[str, torch.Tensor]]:
    """``base`` after a small update: a few elements of each float tensor change (as a bf16 Adam step at
    an RL learning rate does), and one tensor changes whole (its delta would not be smaller)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for name, t in base:
        t = t.clone()
        flat = t.view(-1) if t.dim() else t.view(1)
        if name == "layers.0.norm.weight":
            flat.copy_(torch.randn(flat.shape, generator=g).to(t.dtype))
        else:
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 200),), generator=g)
            flat[idx] = torch.randn(idx.shape, generator=g).to(t.dtype)
        out.append((name, t))
    return out


def nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


@pytest.mark.parametrize("backend", ["torch_dist", "ipc"])
def test_delta_versions_serve_exactly_what_whole_ones_do_and_carry_a_fraction_of_the_bytes(servers, backend):
    url = servers.start()
    pub = WeightPublisher(config(backend=backend, delta=True), [url], server_kind("embedded"))
    try:
        versions = {1: mixed_tensors(1)}
        report = pub.publish(1, iter(versions[1]))
        assert report.ok == [url] and report.sent == "full"
        assert status(url)["delta_base"] == 1  # kept: the next version may be a delta against it
        for v in (2, 3):
            versions[v] = nudged(versions[v - 1], v)
            report = pub.publish(v, iter(versions[v]))
            assert report.ok == [url] and report.sent == "delta" and report.base == v - 1, report
            assert served(url) == {"version": v, "digest": digest(versions[v])}
            assert report.bytes < 0.25 * nbytes(versions[v])
            assert 0 < report.changed_fraction < 0.2
        assert status(url)["failed_versions"] == 0
    finally:
        pub.close()


def test_a_delta_to_a_server_that_lost_its_base_is_refused_by_name_and_it_gets_the_whole_version(servers):
    url = servers.start()
    pub = WeightPublisher(config(delta=True), [url], server_kind("embedded"))
    try:
        v1, v2 = mixed_tensors(1), nudged(mixed_tensors(1), 2)
        assert pub.publish(1, iter(v1)).ok == [url]
        servers.restart(url)  # the publisher does not know: it still believes the server is on version 1
        report = pub.publish(2, iter(v2))
        assert report.retried and report.ok == [url] and report.sent == "full"
        assert served(url) == {"version": 2, "digest": digest(v2)}  # never a mix, never the old version
        v3 = nudged(v2, 3)
        report = pub.publish(3, iter(v3))  # it is on the previous version again: deltas resume
        assert report.sent == "delta" and served(url) == {"version": 3, "digest": digest(v3)}
        # Another sender's whole version (no delta) replaced what the server kept, on a link that still
        # works: the delta against version 3 is refused at its first bucket, by name, then sent whole.
        other = WeightPublisher(config(), [url], server_kind("embedded"))
        try:
            assert other.publish(4, iter(v3)).ok == [url]
        finally:
            other.close()
        assert status(url)["delta_base"] is None
        v5 = nudged(v3, 5)
        report = pub.publish(5, iter(v5))
        assert report.retried and report.ok == [url] and report.sent == "full"
        assert "is a delta against version 3, but this receiver holds no base" in status(url)["last_error"]
        assert served(url) == {"version": 5, "digest": digest(v5)}
    finally:
        pub.close()


# --------------------------------------------------------------------------------------------------- LoRA

ADAPTED = {"layers.0.attn.q": (64, 48), "lm_head": (33, 17)}  # module -> base weight [out, in]
RANK, ALPHA = 4, 8.0
SCALE = ALPHA / RANK


def adapters(step: int, bad: bool = False) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(500 + step)
    dtypes = {"layers.0.attn.q": torch.bfloat16, "lm_head": torch.float32}
    out = []
    for module, (o, i) in ADAPTED.items():
        a = torch.randn(RANK, i - (1 if bad else 0), generator=g).to(dtypes[module])
        b = torch.randn(o, RANK, generator=g).mul(0.1).to(dtypes[module])
        out += [(f"{module}.lora_A.weight", a), (f"{module}.lora_B.weight", b)]
    return out


def merged(base: list[tuple[str, torch.Tensor]], adapter: list[tuple[str, torch.Tensor]]) -> dict:
    """What a whole push of the LoRA policy serves: each adapted weight merged, the rest as it is."""
    ad = dict(adapter)
    out = {}
    for name, w in base:
        module = name.removesuffix(".weight")
        if module in ADAPTED:
            w = merge_lora(w, ad[f"{module}.lora_A.weight"], ad[f"{module}.lora_B.weight"], SCALE)
        out[name] = w
    return out


def test_adapter_only_versions_serve_the_merged_policy_exactly_and_carry_only_the_adapters(servers):
    url = servers.start()
    pub = WeightPublisher(config(), [url], server_kind("embedded"))
    base = mixed_tensors(1)
    try:
        assert pub.needs_full()
        report = publish_lora(pub, 1, lambda: iter(adapters(1)), lambda: iter(base), SCALE)
        assert report is not None and report.ok == [url] and report.sent == "lora"
        assert served(url) == {"version": 1, "digest": digest(merged(base, adapters(1)))}
        assert status(url)["lora_base"] == len(ADAPTED)
        assert not pub.needs_full()
        for v in (2, 3):
            report = publish_lora(
                pub, v, lambda v=v: iter(adapters(v)), lambda: pytest.fail("base gathered"), SCALE
            )
            assert report.ok == [url] and report.sent == "adapters"
            assert served(url) == {"version": v, "digest": digest(merged(base, adapters(v)))}
            assert report.bytes < nbytes(adapters(v)) + 64 * 8  # the adapters' bytes (and alignment)
    finally:
        pub.close()


def test_lora_guards_a_misshaped_adapter_and_a_server_without_the_base_weights(servers):
    url = servers.start()
    pub = WeightPublisher(config(), [url], server_kind("embedded"))
    base = mixed_tensors(1)
    try:
        publish_lora(pub, 1, lambda: iter(adapters(1)), lambda: iter(base), SCALE)
        # a restarted server lost its base weights; adapters alone are refused by name, then it gets all
        servers.restart(url)
        report = pub.publish_lora(2, iter(adapters(2)), None, SCALE)
        assert report.retried and report.ok == [url] and report.sent == "lora"
        assert served(url) == {"version": 2, "digest": digest(merged(base, adapters(2)))}
        # an adapter whose A does not fit its base weight: refused by name at the push, version 2 serves
        report = pub.publish_lora(3, iter(adapters(3, bad=True)), None, SCALE)
        assert url in report.failed and not report.ok
        assert "do not fit the base weight" in status(url)["last_error"]
        assert served(url) == {"version": 2, "digest": digest(merged(base, adapters(2)))}
        assert pub.needs_full()  # after a failed push the next LoRA version carries the base again
    finally:
        pub.close()


def test_adapters_alone_are_not_sent_to_servers_the_publisher_has_not_seen_take_the_base():
    """Before any LoRA version reached the servers, an adapter-only push fails before a byte moves."""
    from slipstream.weightsync.errors import TransferError

    pub = WeightPublisher(config(), ["http://127.0.0.1:9"], server_kind("embedded"))
    try:
        with pytest.raises(TransferError, match="hold no LoRA base weights"):
            pub.publish_lora(1, iter(adapters(1)), None, SCALE)
    finally:
        pub.close()


def test_a_receiver_without_lora_base_weights_refuses_adapters_alone_by_name():
    """What a restarted server says when adapters alone reach it on a link that still works."""
    from slipstream.weightsync.send_less import Rebuilder, SendLessError
    from slipstream.weightsync.types import LORA_A, LORA_B, VersionInfo

    parts = {(LORA_A if ".lora_A" in n else LORA_B, n): t for n, t in adapters(1)}
    with pytest.raises(SendLessError, match="holds no LoRA base weights .* it needs a full push"):
        Rebuilder().rebuild({}, parts, VersionInfo(lora_scale=SCALE), 7)


# ------------------------------------------------------------------------------------------ config guards

CONFIGS = __import__("pathlib").Path(__file__).parents[2] / "configs"


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.backend=sglang", "cluster.gpus_per_server=1"],
        ["rollout.backend=vllm", "rollout.vllm.weight_transfer=nccl", "cluster.gpus_per_server=1"],
    ],
)
def test_delta_pushes_to_servers_that_cannot_rebuild_them_are_refused_at_config_check(overrides):
    from slipstream.config import ConfigError, load_config
    from slipstream.pipeline.modes import check_config, prepare_config

    cfg, _ = prepare_config(load_config(CONFIGS / "quickstart.yaml", ["weightsync.delta=true", *overrides]))
    with pytest.raises(
        ConfigError, match=r"weightsync.delta: delta pushes need servers that rebuild .* cannot take them"
    ):
        check_config(cfg, environment=False)
    fine, _ = prepare_config(load_config(CONFIGS / "quickstart.yaml", ["weightsync.delta=true"]))
    check_config(fine, environment=False)  # the same with the preset's servers passes


@pytest.mark.parametrize(
    "overrides",
    [
        ["rollout.backend=sglang", "cluster.gpus_per_server=1"],
        ["rollout.backend=vllm", "rollout.vllm.weight_transfer=nccl", "cluster.gpus_per_server=1"],
    ],
)
def test_lora_with_servers_that_cannot_rebuild_adapters_is_accepted_and_pushes_merged_weights(overrides):
    """SGLang's one in-memory LoRA route unpickles, and vLLM's own engine reads dense tensors: a LoRA run
    pushes them merged whole weights (test_send_less_merged.py), so the config passes; a delta does not."""
    from slipstream.config import ConfigError, load_config
    from slipstream.pipeline.modes import check_config, prepare_config

    cfg, _ = prepare_config(load_config(CONFIGS / "quickstart_lora.yaml", overrides))
    check_config(cfg, environment=False)
    delta, _ = prepare_config(
        load_config(CONFIGS / "quickstart_lora.yaml", [*overrides, "weightsync.delta=true"])
    )
    with pytest.raises(ConfigError, match=r"^weightsync.delta: .* cannot take them"):
        check_config(delta, environment=False)


def test_delta_in_a_lora_run_is_refused_rather_than_ignored():
    """The LoRA preset's servers rebuild deltas, but a LoRA version is its adapters: a delta setting there
    would do nothing, silently."""
    from slipstream.config import ConfigError, load_config
    from slipstream.pipeline.modes import check_config, prepare_config

    cfg, _ = prepare_config(load_config(CONFIGS / "quickstart_lora.yaml", ["weightsync.delta=true"]))
    with pytest.raises(
        ConfigError, match=r"^weightsync.delta: a LoRA run \(trainer.lora\) pushes its adapters"
    ):
        check_config(cfg, environment=False)


def test_a_publisher_refuses_send_less_pushes_its_servers_or_transport_cannot_carry():
    """SGLang reads every entry as a dense tensor, and the per-tensor `naive` calls name no entry kinds:
    delta and LoRA pushes to them are refused before a byte moves, not read as weights."""
    with pytest.raises(ValueError, match="weightsync.delta: `sglang` servers cannot rebuild"):
        WeightPublisher(config(delta=True), [], server_kind("sglang"))
    with pytest.raises(ValueError, match="weightsync.delta: weightsync.backend `naive` sends no entry kinds"):
        WeightPublisher(config(delta=True, backend="naive"), [], server_kind("embedded"))
    pub = WeightPublisher(config(), [], server_kind("sglang"))
    try:
        with pytest.raises(ValueError, match="LoRA adapter pushes: `sglang` servers cannot rebuild"):
            pub.publish_lora(1, iter(adapters(1)), iter(mixed_tensors(1)), SCALE)
    finally:
        pub.close()
