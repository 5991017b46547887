"""Images of vision-language prompts through the queue: once per group (the prompt's), as one uint8 column cut by
the header's ``image_nbytes`` (never pickled), back byte for byte from a live server with shared memory and
without, counted by the queue's byte bounds, collated once per group; a header that does not match the column
is refused at put with the reason."""

from __future__ import annotations

import io

import pytest
import torch

from slipstream.queue import codec as C
from slipstream.queue.batch import collate
from slipstream.queue.client import QueueClient
from slipstream.queue.errors import QueueFull
from slipstream.queue.testing import make_group
from slipstream.queue.types import IMAGE_COLUMN, TrajectoryGroup


def png(size: int, colour: str) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.effect_noise((size, size), 64).convert("RGB").save(buf, format="PNG")  # noise: PNG cannot shrink it
    return buf.getvalue()


def image_group(gid: str, n: int, images: list[bytes]) -> TrajectoryGroup:
    text = make_group(gid, n=n, prompt_len=20, response_len=6)
    return TrajectoryGroup.from_trajectories(text.to_trajectories(), images=images)


def test_images_travel_once_per_group_whatever_n():
    images = [png(112, "red"), png(56, "blue")]
    one, eight = image_group("a", 1, images), image_group("b", 8, images)
    assert one.meta.image_nbytes == [len(im) for im in images]
    assert one.images == images and eight.images == images
    image_bytes = sum(len(im) for im in images)
    assert one.tensors[IMAGE_COLUMN].numel() == eight.tensors[IMAGE_COLUMN].numel() == image_bytes
    text_bytes = make_group("c", n=8, prompt_len=20, response_len=6).nbytes
    assert eight.nbytes == text_bytes + image_bytes  # not 8 copies
    assert make_group("c").images == []


def test_a_header_that_does_not_match_the_image_column_is_refused():
    group = image_group("g", 2, [png(56, "red")])
    specs, size = C.layout_region(group.tensors, inline_bytes=16)
    C.validate_group(group.meta, specs, [size])
    group.meta.image_nbytes = [group.meta.image_nbytes[0] + 1]
    with pytest.raises(C.WireError, match="tensor `images`: first dimension"):
        C.validate_group(group.meta, specs, [size])
    with pytest.raises(ValueError, match="column `images` has shape"):
        group.validate()
    group.meta.image_nbytes = [0]
    with pytest.raises(C.WireError, match="an image of 0 bytes"):
        C.validate_group(group.meta, specs, [size])
    no_column = {k: v for k, v in group.tensors.items() if k != IMAGE_COLUMN}
    group.meta.image_nbytes = [10]
    specs, size = C.layout_region(no_column, inline_bytes=16)
    with pytest.raises(C.WireError, match="lists images but `images` is missing"):
        C.validate_group(group.meta, specs, [size])


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "socket"])
def test_images_come_back_byte_for_byte_from_a_live_queue(server, shared_memory):
    srv = server(shm_min_group_bytes=1024)
    producer = QueueClient(srv.address, timeout_s=30, shared_memory=shared_memory)
    consumer = QueueClient(srv.address, timeout_s=30, shared_memory=shared_memory)
    try:
        images = [png(112, "red"), png(84, "green")]
        groups = [image_group("g0", 4, images), make_group("t0"), image_group("g1", 2, images[1:])]
        assert all(producer.put(g) for g in groups)
        assert consumer.stats().held_bytes >= sum(g.nbytes for g in groups)
        lease = consumer.lease(3, timeout_s=5)
        got = {g.group_id: g for g in lease.groups}
        assert got["g0"].images == images and got["g1"].images == images[1:] and got["t0"].images == []
        batch = collate(lease.groups)
        consumer.ack(lease)
    finally:
        producer.close()
        consumer.close()
    order = [g.group_id for g in lease.groups]
    owners = [order.index(gid) for gid in ("g0", "g0", "g1")]
    assert sorted(batch["image_groups"].tolist()) == sorted(owners)
    assert batch["image_bytes"].numel() == sum(len(im) for im in images) + len(images[1])
    assert "images" not in batch.keys()  # not taken for a response-aligned extra


def test_image_bytes_count_against_the_queues_byte_capacity(server):
    images = [png(112, "red")]
    group = image_group("g0", 2, images)
    srv = server(capacity_bytes=group.nbytes + 100)
    client = QueueClient(srv.address, timeout_s=30)
    try:
        assert client.put(group)
        with pytest.raises(QueueFull):
            client.put(image_group("g1", 2, images), timeout_s=0.5)
    finally:
        client.close()


def test_collate_keeps_one_copy_per_group_and_the_trainer_gives_each_sample_its_pixels(tmp_path):
    from slipstream.trainer.engine.vision import ImageProcessor, attach_pixels
    from slipstream.utils.tiny_vlm import make_tiny_qwen2_vl

    red, blue = png(112, "red"), png(56, "blue")
    batch = collate([image_group("a", 3, [red, blue]), make_group("t", n=2), image_group("b", 2, [blue])])
    assert batch["image_nbytes"].tolist() == [len(red), len(blue), len(blue)]
    assert batch["image_groups"].tolist() == [0, 0, 2]
    processor = ImageProcessor(str(make_tiny_qwen2_vl(tmp_path / "vlm")))
    attach_pixels(batch, processor)
    assert batch["image_counts"].tolist() == [2, 2, 2, 0, 0, 1, 1]
    one = processor([[red, blue]])
    per_sample = one["pixel_values"].shape[0]
    assert torch.equal(batch["pixel_values"][:per_sample], one["pixel_values"])
    assert torch.equal(batch["pixel_values"][2 * per_sample : 3 * per_sample], one["pixel_values"])
    assert batch["image_grid_thw"].shape == (3 * 2 + 2 * 1, 3)
    assert "image_bytes" not in batch.keys()
