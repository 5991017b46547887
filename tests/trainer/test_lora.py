"""LoRA on the FSDP2 engine (trainer/engine/lora.py): only adapters train, pushes carry the merged model,
the KL reference is the base model without a second copy, checkpoints resume adapters and their optimizer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slipstream.trainer.algos.aggregation import global_counts
from slipstream.trainer.batching import partition_for_ranks, sample_lengths, select_samples
from slipstream.trainer.engine import make_aux_engines
from slipstream.trainer.engine.fsdp import FSDPEngine
from slipstream.trainer.engine.lora import BaseModelReference, LoRALinear, lora_layers
from slipstream.trainer.synthetic import make_packed_batch
from slipstream.utils.net import free_port
from slipstream.weightsync.delta import adapter_shapes, bits_view, is_adapter_name, merge_adapters
from tests.trainer.conftest import RecordingPublisher, trainer_config, trainer_settings

LORA = ("trainer.lora.rank=4", "trainer.lora.alpha=8")


def _engine(model_path, *overrides):
    engine = FSDPEngine(trainer_settings(model_path, *overrides))
    engine.initialize()
    return engine


def _batch(seed=0):
    return make_packed_batch([3, 5, 2, 4, 6], [4, 1, 7, 3, 5], vocab_size=200, seed=seed, group_size=5)


def _nll(outputs, mb):
    mask = mb["loss_mask"].float()
    return -(outputs["logprobs"] * mask).sum() / 20.0, {}


def _logprobs(engine, batch):
    return engine.forward_backward_batch(batch, None, forward_only=True).tokens["logprobs"]


def _train(engine, steps, seed=0):
    losses = []
    for _ in range(steps):
        losses.append(engine.forward_backward_batch(_batch(seed), _nll).metrics["loss"])
        engine.optimizer_step()
        engine.lr_scheduler_step()
    return losses


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits_view(a), bits_view(b))


# ------------------------------------------------------------------------------------------ config
def test_lora_config_is_validated(tiny_model_path):
    from slipstream.config_base import ConfigError

    cfg = trainer_config(tiny_model_path, *LORA)
    assert cfg.trainer.lora.enabled and cfg.trainer.lora.rank == 4
    assert "q_proj" in cfg.trainer.lora.target_modules and "down_proj" in cfg.trainer.lora.target_modules
    assert not trainer_config(tiny_model_path).trainer.lora.enabled
    with pytest.raises((ValueError, ConfigError), match="lm_head"):
        trainer_config(tiny_model_path, *LORA, "trainer.lora.target_modules=[lm_head]")
    with pytest.raises((ValueError, ConfigError), match="fsdp"):
        trainer_config(tiny_model_path, *LORA, "trainer.engine=megatron")
    with pytest.raises((ValueError, ConfigError)):
        trainer_config(tiny_model_path, *LORA, "trainer.lora.dropout=1.0")


def test_targets_matching_nothing_are_an_error(tiny_model_path, single_process_group):
    with pytest.raises(ValueError, match="match no module.*q_proj"):
        _engine(tiny_model_path, *LORA, "trainer.lora.target_modules=[qkv]")


# ------------------------------------------------------------------------------------------ training
@pytest.mark.parametrize("chunk", [4096, 0])
def test_lora_starts_at_the_base_model_and_trains_only_adapters(tiny_model_path, single_process_group, chunk):
    full = _engine(tiny_model_path, f"trainer.logits_chunk_tokens={chunk}")
    engine = _engine(
        tiny_model_path,
        *LORA,
        "trainer.lr=1e-2",
        f"trainer.logits_chunk_tokens={chunk}",
        "trainer.activation_checkpointing=true",
    )
    layers = lora_layers(engine.model)
    assert len(layers) == 2 * 7  # 2 layers x (q, k, v, o, gate, up, down)
    assert all(isinstance(m, LoRALinear) for m in layers.values())
    batch = _batch()
    torch.testing.assert_close(_logprobs(engine, batch), _logprobs(full, batch), atol=0, rtol=0)

    trained = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trained and all(is_adapter_name(n) for n in trained)
    n_opt = sum(len(g["params"]) for g in engine.optimizer.param_groups)
    assert n_opt == len(trained) == 2 * len(layers)
    base_before = {n: t.clone() for n, t in full.get_per_tensor_param()}
    losses = _train(engine, 8)
    assert losses[-1] < losses[0] * 0.9, losses
    for name, param in engine.model.named_parameters():
        if not is_adapter_name(name):
            assert param.grad is None
            assert _same_bits(param.full_tensor(), base_before[name]), name


def test_merged_push_serves_what_the_trainer_computes(tiny_model_path, single_process_group):
    """The merged tensors under HF names, loaded into a plain HF model, give the trainer's logprobs; and a
    receiver merging the adapters into the base with weightsync/delta.py gets the same bits."""
    from transformers import AutoModelForCausalLM

    engine = _engine(tiny_model_path, *LORA)
    _train(engine, 4)
    merged = dict(engine.get_per_tensor_param())
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    base = {n: p.detach().clone() for n, p in hf.named_parameters()}
    assert set(merged) == set(base)  # HF names, no adapter tensors, tied weights once
    adapters = dict(engine.get_adapter_params())
    assert adapters and all(is_adapter_name(n) for n in adapters)
    # the receiver's view of the adapter (weightsync/delta.py) names and shapes it as the trainer does
    shapes = [(n, tuple(t.shape)) for n, t in base.items()]
    assert adapter_shapes(shapes, 4, engine.tcfg.lora.target_modules) == [
        (n, tuple(t.shape)) for n, t in adapters.items()
    ]
    received = merge_adapters(base, adapters, scale=8 / 4)
    assert len(received) == 14
    for name, tensor in merged.items():
        want = received.get(name, base[name])
        assert _same_bits(tensor, want), name
    changed = [n for n in received if not torch.equal(received[n], base[n])]
    assert changed, "training moved no adapted weight"

    hf.load_state_dict(merged, strict=False)
    hf.eval()
    batch = _batch(5)
    want = _logprobs(engine, batch)
    cu = batch["cu_seqlens"].long().tolist()
    ids = batch["input_ids"].long()
    for s, e in zip(cu[:-1], cu[1:], strict=True):
        with torch.no_grad():
            logits = hf(input_ids=ids[None, s:e]).logits[0].float()
        lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[s + 1 : e, None])[:, 0]
        mask = batch["loss_mask"][s + 1 : e].bool()
        torch.testing.assert_close(want[s + 1 : e][mask], lp[mask], atol=1e-5, rtol=1e-5)


def test_dropout_applies_to_training_passes_only(tiny_model_path, single_process_group):
    engine = _engine(tiny_model_path, *LORA, "trainer.lora.dropout=0.5")
    _train(engine, 2)
    batch = _batch()
    torch.testing.assert_close(_logprobs(engine, batch), _logprobs(engine, batch), atol=0, rtol=0)
    first = engine.forward_backward_batch(batch, _nll).metrics["loss"]
    second = engine.forward_backward_batch(batch, _nll).metrics["loss"]
    assert first != second


# ------------------------------------------------------------------------------------------ reference
def test_reference_is_the_base_model_without_a_second_copy(tiny_model_path, single_process_group):
    kl = (
        "trainer.algorithm.kl_type=k3",
        "trainer.algorithm.kl_coef=0.01",
        "trainer.algorithm.kl_reference=reference",
    )
    full = _engine(tiny_model_path)
    engine = _engine(tiny_model_path, *LORA, *kl)
    aux = make_aux_engines(engine.settings, policy=engine)
    ref = aux["reference"]
    assert isinstance(ref, BaseModelReference) and ref.policy is engine
    _train(engine, 4)
    batch = _batch(3)
    policy_before = _logprobs(engine, batch)
    base = _logprobs(full, batch)
    torch.testing.assert_close(_logprobs(ref, batch), base, atol=0, rtol=0)
    assert not torch.allclose(policy_before, base)
    torch.testing.assert_close(_logprobs(engine, batch), policy_before, atol=0, rtol=0)  # adapters back on
    with pytest.raises(ValueError, match="forward only"):
        ref.forward_backward_batch(batch, _nll)
    # another checkpoint as reference still gets its own frozen copy
    other = make_aux_engines(
        trainer_settings(
            tiny_model_path, *LORA, *kl, f"trainer.algorithm.reference_path={tiny_model_path}/."
        ),
        policy=engine,
    )["reference"]
    assert isinstance(other, FSDPEngine) and other.frozen


# ------------------------------------------------------------------------------------------ checkpoints
def test_checkpoint_resumes_adapters_and_their_optimizer(tiny_model_path, single_process_group, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    engine = _engine(tiny_model_path, *LORA, "trainer.warmup_steps=3")
    _train(engine, 2)
    engine.save_checkpoint(tmp_path / "ckpt")
    keys = FileSystemReader(str(tmp_path / "ckpt" / "dcp")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(is_adapter_name(k.removeprefix("model.")) for k in model_keys)
    assert any(k.startswith("optim.state.") and k.endswith("exp_avg_sq") for k in keys)

    ref_loss = engine.forward_backward_batch(_batch(7), _nll).metrics["loss"]
    ref_norm = engine.optimizer_step()
    ref_lr = engine.lr_scheduler_step()
    ref = dict(engine.get_adapter_params())

    fresh = FSDPEngine(engine.settings)
    fresh.initialize()
    fresh.load_checkpoint(tmp_path / "ckpt")
    assert fresh.forward_backward_batch(_batch(7), _nll).metrics["loss"] == pytest.approx(ref_loss, rel=1e-6)
    assert fresh.optimizer_step() == pytest.approx(ref_norm, rel=1e-6)
    assert fresh.lr_scheduler_step() == pytest.approx(ref_lr)
    for name, tensor in fresh.get_adapter_params():
        assert _same_bits(tensor, ref[name]), name

    with pytest.raises(ValueError, match="does not match trainer.lora"):
        _engine(tiny_model_path, "trainer.lora.rank=2").load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="a LoRA checkpoint"):
        _engine(tiny_model_path).load_checkpoint(tmp_path / "ckpt")


# ------------------------------------------------------------------------------------------ 2 gloo ranks
def _step(engine, rank, world):
    batch = _batch(1)
    tokens, _ = global_counts(batch["loss_mask"], batch["cu_seqlens"])
    shard = select_samples(batch, partition_for_ranks(sample_lengths(batch), world)[rank])

    def loss_fn(outputs, mb):
        return -(outputs["logprobs"] * mb["loss_mask"].float()).sum() / tokens, {}

    for _ in range(3):
        engine.forward_backward_batch(shard, loss_fn)
        engine.optimizer_step()
    return dict(engine.get_per_tensor_param()), dict(engine.get_adapter_params())


def _worker(rank, world, port, model_path, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        engine = FSDPEngine(trainer_settings(model_path, *LORA, "trainer.micro_batch_tokens=8"))
        engine.initialize()
        merged, adapters = _step(engine, rank, world)
        engine.save_checkpoint(f"{out_dir}/ckpt")
        if rank == 0:
            torch.save({"merged": merged, "adapters": adapters}, f"{out_dir}/dist.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_train_the_same_adapters_as_one(tiny_model_path, single_process_group, tmp_path):
    port = free_port()
    mp.start_processes(
        _worker, args=(2, port, str(tiny_model_path), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    got = torch.load(tmp_path / "dist.pt", weights_only=False)
    engine = _engine(tiny_model_path, *LORA, "trainer.micro_batch_tokens=8")
    merged, adapters = _step(engine, 0, 1)
    assert set(got["adapters"]) == set(adapters)
    for name, tensor in adapters.items():
        torch.testing.assert_close(got["adapters"][name], tensor, atol=1e-6, rtol=1e-4)
    for name, tensor in merged.items():
        torch.testing.assert_close(got["merged"][name], tensor, atol=1e-6, rtol=1e-4)
    # the adapters the 2 ranks saved resume in 1
    fresh = _engine(tiny_model_path, *LORA, "trainer.micro_batch_tokens=8")
    fresh.load_checkpoint(tmp_path / "ckpt")
    for name, tensor in fresh.get_adapter_params():
        assert torch.equal(tensor, got["adapters"][name]), name


# ------------------------------------------------------------------------------------------ trainer loop
def test_trainer_steps_with_a_kl_reference_and_publishes_the_adapters(
    tiny_model_path, single_process_group, tmp_path
):
    """A LoRA policy with a KL penalty against the base model runs whole trainer steps: the reference pass
    reads the base weights (KL 0 at step 0, > 0 once the adapters moved), pushes carry the adapters (or
    what the publisher asks for), and a checkpoint taken by the loop resumes the adapters."""
    from slipstream.trainer.trainer import Trainer, latest_checkpoint
    from tests.trainer.fake_queue import FakeQueue, collate, make_group

    cfg = trainer_settings(
        tiny_model_path,
        *LORA,
        "trainer.lr=1e-2",
        "trainer.batch_groups=2",
        "trainer.checkpoint_every=2",
        "trainer.algorithm.kl_type=k3",
        "trainer.algorithm.kl_coef=0.1",
        "trainer.algorithm.kl_reference=reference",
        f"run.output_dir={tmp_path}",
    )
    queue = FakeQueue(snapshot_dir=tmp_path / cfg.run.name / "checkpoints")
    for i in range(8):
        queue.put(make_group(f"g{i}", 4, version=0, seed=i))
    engine = FSDPEngine(cfg)
    engine.initialize()
    publisher = RecordingPublisher(lora_push="adapters")
    trainer = Trainer(
        cfg,
        engine,
        queue,
        rank=0,
        world_size=1,
        collate_fn=collate,
        publisher=publisher,
        **make_aux_engines(cfg, policy=engine),
    )
    assert isinstance(trainer.reference, BaseModelReference)
    kls = [trainer.step() for _ in range(3)]
    kl_key = "trainer/kl"
    assert kl_key in kls[0], sorted(kls[0])
    assert kls[0][kl_key] == pytest.approx(0.0, abs=1e-6)
    assert kls[2][kl_key] > 1e-6
    # a standalone trainer pushes as the pipeline's ranks do (Trainer.push): the adapters alone here
    assert [(v, sent) for v, sent, _ in publisher.pushes] == [
        (1, "adapters"),
        (2, "adapters"),
        (3, "adapters"),
    ]
    assert set(publisher.pushes[-1][2]) == {n for n, _ in engine.get_adapter_params()}
    # with the base weights to servers that lack them; merged whole weights to servers that cannot rebuild
    for how, names in [
        (
            "lora",
            {n for n, _ in engine.get_adapter_params()}
            | {n for n, _ in engine.base_reference().get_per_tensor_param()},
        ),
        ("merged", {n for n, _ in engine.get_per_tensor_param()}),
    ]:
        other = RecordingPublisher(lora_push=how)
        trainer.push(other, 4)
        assert [(v, sent) for v, sent, _ in other.pushes] == [(4, how)] and set(other.pushes[0][2]) == names
    assert not any(is_adapter_name(n) for n in other.pushes[0][2])  # merged: plain HF names

    ckpt = latest_checkpoint(trainer.checkpoint_root)
    assert ckpt is not None and ckpt.name == "step_00000002"
    fresh = FSDPEngine(cfg)
    fresh.initialize()
    second = Trainer(
        cfg,
        fresh,
        FakeQueue(snapshot_dir=queue.snapshot_dir),
        rank=0,
        world_size=1,
        collate_fn=collate,
        **make_aux_engines(cfg, policy=fresh),
    )
    second.resume(ckpt)
    assert second.version == 2
    assert any(p.abs().sum() > 0 for n, p in fresh.get_adapter_params() if n.endswith("lora_B.weight"))


def test_a_lora_version_served_merged_and_served_from_adapters_is_one_policy_in_bf16(
    tiny_model_path, single_process_group
):
    """The merged push (to a server that cannot rebuild adapters) and the adapter push (base weights and
    adapters in the push dtype, merged by the receiver) give the same served weights, bit for bit, in bf16:
    both merge the bf16 W, A and B in fp32 and round once."""
    engine = _engine(tiny_model_path, *LORA)
    _train(engine, 4)
    bf16 = torch.bfloat16
    merged = dict(engine.get_per_tensor_param(bf16))
    base = dict(engine.base_reference().get_per_tensor_param(bf16))
    received = merge_adapters(base, dict(engine.get_adapter_params(bf16)), scale=8 / 4)
    assert len(received) == 14 and all(t.dtype == bf16 for t in merged.values())
    for name, tensor in merged.items():
        assert _same_bits(tensor, received.get(name, base[name])), name
    # what a merge in fp32 rounded after (the older merged push) would have served differs
    fp32 = dict(engine.get_per_tensor_param())
    assert any(not _same_bits(fp32[n].to(bf16), received[n]) for n in received)
