"""The step batch crosses ranks whole: fixed keys, the optional reference logprobs, extra per-token tensors an
agent added (any dtype, any trailing shape) and an image batch's pixel inputs (per patch, per image, per
sample), over a real 2-rank gloo group."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slipstream.trainer.dist import broadcast_batch
from slipstream.trainer.synthetic import make_packed_batch
from slipstream.utils.net import free_port


def _batch():
    batch = make_packed_batch([3, 5, 2], [4, 1, 6], vocab_size=50, seed=1)
    t = batch["input_ids"].numel()
    batch["ref_logprobs"] = torch.linspace(-3, 0, t)
    batch["token_bonus"] = torch.arange(t, dtype=torch.float32) / 7
    batch["features"] = torch.arange(t * 3, dtype=torch.bfloat16).reshape(t, 3)
    batch["is_tool"] = torch.arange(t) % 2 == 0
    batch["pixel_values"] = torch.linspace(-1, 1, 20 * 6).reshape(20, 6)  # 20 patches over 2 images
    batch["image_grid_thw"] = torch.tensor([[1, 2, 4], [1, 4, 3]], dtype=torch.int32)
    batch["image_counts"] = torch.tensor([1, 0, 1], dtype=torch.int32)
    return batch


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        got = broadcast_batch(_batch() if rank == 0 else None)
        if rank == 1:
            torch.save({k: got[k] for k in got.keys() if isinstance(got.get(k), torch.Tensor)}, out)
    finally:
        dist.destroy_process_group()


def test_every_tensor_of_the_batch_reaches_the_other_rank(tmp_path):
    out = tmp_path / "rank1.pt"
    mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=2, start_method="spawn")
    got, want = torch.load(out), _batch()
    tensor_keys = {k for k in want.keys() if isinstance(want.get(k), torch.Tensor)}
    assert set(got) == tensor_keys
    for key in tensor_keys:
        assert got[key].dtype == want[key].dtype, key
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
