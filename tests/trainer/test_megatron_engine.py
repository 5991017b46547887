"""Megatron-core engine on one GPU: HF weights load exactly (the exported tensors equal the checkpoint's),
and a few steps on a fixed batch lower the loss. Skipped without a GPU and megatron-core."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_megatron_engine_round_trip_and_learns(tiny_model_path, tmp_path):
    pytest.importorskip("megatron.core")
    import torch.distributed as dist
    from safetensors.torch import load_file

    from slipstream.trainer.engine.megatron import MegatronEngine
    from slipstream.trainer.synthetic import make_packed_batch
    from slipstream.utils.net import free_port
    from tests.trainer.conftest import trainer_settings

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        engine = MegatronEngine(
            trainer_settings(tiny_model_path, "trainer.engine=megatron", "trainer.device=cuda")
        )
        engine.initialize()
        hf = load_file(str(next(tiny_model_path.glob("*.safetensors"))))
        for name, tensor in engine.get_per_tensor_param(dtype=torch.float32):
            torch.testing.assert_close(tensor.cpu(), hf[name].float(), atol=1e-2, rtol=1e-2)  # bf16 params
        batch = make_packed_batch([3, 5, 2], [4, 6, 7], vocab_size=200, seed=0)

        def nll(outputs, mb):
            mask = mb["loss_mask"].float()
            return -(outputs["logprobs"] * mask).sum() / 17.0, {}

        losses = []
        for _ in range(6):
            losses.append(engine.forward_backward_batch(batch, nll).metrics["loss"])
            engine.optimizer_step()
        assert losses[-1] < losses[0]
        engine.save_checkpoint(tmp_path / "ckpt")
    finally:
        dist.destroy_process_group()


def test_fsdp_bf16_step_on_gpu(tiny_model_path):
    """bf16 compute with fp32 master weights on one GPU: a step runs and parameters stay fp32."""
    import torch.distributed as dist

    from slipstream.trainer.engine.fsdp import FSDPEngine
    from slipstream.trainer.synthetic import make_packed_batch
    from tests.trainer.conftest import trainer_settings

    engine = FSDPEngine(
        trainer_settings(tiny_model_path, "trainer.device=cuda", "trainer.attn_implementation=sdpa_varlen")
    )
    engine.initialize()
    try:
        batch = make_packed_batch([3, 5], [4, 6], vocab_size=200)
        out = engine.forward_backward_batch(
            batch, lambda o, mb: (-(o["logprobs"] * mb["loss_mask"]).sum(), {})
        )
        assert torch.isfinite(torch.tensor(out.metrics["loss"]))
        assert engine.optimizer_step() > 0
        assert all(p.dtype == torch.float32 for p in engine.model.parameters())
    finally:
        dist.destroy_process_group()
