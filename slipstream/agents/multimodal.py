"""Images of multi-modal prompts: read from verl's parquet, checked one by one, kept encoded.

verl's multi-modal datasets (geo3k, and what ``slipstream data make shapes`` writes) add an ``images``
column to the text format: a list per row, each item one of

* the encoded bytes of a PNG, JPEG or WebP file;
* a mapping ``{"bytes": ..., "path": ...}``, as HF ``datasets`` stores an ``Image`` feature (bytes win when
  both are set);
* a path, absolute or relative to the directory of the dataset file.

and the prompt's messages say where each image goes with a ``<image>`` placeholder, in order: a row's
placeholder count must equal its number of images.

Images stay encoded (:class:`Image`: the file's bytes, its format and its size): a PNG is several times
smaller than its pixels, the servers take encoded images (vLLM's ``content_parts`` data URLs) and resize
them with the model's own processor, so decoding here would only move more bytes. Each image is checked
when the dataset is loaded, with Pillow's lazy ``open`` (the header: format and size, before any pixel is
decoded) and ``verify`` (the file's structure and checksums; for JPEG, whose ``verify`` reads only the
markers, a truncated scan passes and fails later in the server's decode, naming the request).

Worked example::

    images = row_images({"images": [{"bytes": png, "path": None}], ...}, base_dir=Path("data"))
    images[0].format, images[0].width, images[0].height     # ("PNG", 112, 112)
    check_placeholders(messages, len(images))                # raises ImageProblem on a mismatch
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import msgspec

# verl's placeholder for one image in a prompt's text.
IMAGE_PLACEHOLDER = "<image>"
# Formats every Qwen-VL processor and vLLM's data-URL loader decode (Pillow formats' names).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
MIME_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


class ImageLimits(msgspec.Struct, frozen=True, kw_only=True):
    """Bounds on one prompt's images, checked row by row when a dataset is loaded."""

    # Qwen2-VL's processor resizes anything larger down to at most 12,845,056 pixels (3584 x 3584, its
    # max_pixels), so a bigger image costs decode time and bytes on the wire for nothing; it is usually a
    # scan or a photo that belongs resized in the dataset.
    max_pixels: int = 3584 * 3584
    # OpenAI's and most providers' per-image upload limit; a group carries its images through the queue.
    max_bytes: int = 20 * 1024 * 1024
    # At Qwen2-VL's largest resize an image is 16,384 tokens: 16 of them already pass any context window
    # trained here, so more is a data error, not a prompt.
    max_images: int = 16


class Image(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One encoded image of a prompt: the file's bytes as stored (never re-encoded) and what they hold."""

    data: bytes
    # Pillow's name of the format: one of IMAGE_FORMATS.
    format: str
    width: int
    height: int

    @property
    def mime_type(self) -> str:
        return MIME_TYPES[self.format]


class ImageProblem(ValueError):
    """An image (or the placeholders naming it) that a prompt cannot use; the loader adds the row."""


def row_images(row: dict[str, Any], *, base_dir: Path | None, limits: ImageLimits) -> list[Image]:
    """The checked images of ``row``'s ``images`` field (none when it is missing or null)."""
    items = row.get("images")
    if items is None:
        return []
    if not isinstance(items, list | tuple):
        raise ImageProblem(f"field `images` must be a list, got {type(items).__name__}")
    if len(items) > limits.max_images:
        raise ImageProblem(
            f"field `images` has {len(items)} images, more than the {limits.max_images} allowed"
        )
    images = []
    for i, item in enumerate(items):
        try:
            images.append(load_image(item, base_dir=base_dir, limits=limits))
        except ImageProblem as err:
            raise ImageProblem(f"field `images[{i}]`: {err}") from None
    return images


def load_image(item: Any, *, base_dir: Path | None, limits: ImageLimits) -> Image:
    """One ``images`` item (bytes, ``{"bytes", "path"}`` or a path) read and checked."""
    data, path = _item_source(item)
    if data is None:
        data = _read_file(Path(path), base_dir, limits)
    return decode_image(bytes(data), limits=limits)


def _item_source(item: Any) -> tuple[bytes | None, str | None]:
    if isinstance(item, bytes | bytearray | memoryview):
        return bytes(item), None
    if isinstance(item, str):
        return None, item
    if isinstance(item, dict):
        data, path = item.get("bytes"), item.get("path")
        if data is not None:
            if not isinstance(data, bytes | bytearray | memoryview):
                raise ImageProblem(f"`bytes` must be bytes, got {type(data).__name__}")
            return bytes(data), None
        if isinstance(path, str) and path:
            return None, path
        raise ImageProblem("has neither `bytes` nor `path`")
    raise ImageProblem(f"must be bytes, a path or a {{bytes, path}} mapping, got {type(item).__name__}")


def _read_file(path: Path, base_dir: Path | None, limits: ImageLimits) -> bytes:
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if not path.is_file():
        raise ImageProblem(f"image file {path} does not exist")
    size = path.stat().st_size
    if size > limits.max_bytes:
        raise ImageProblem(f"image file {path} is {size} bytes, more than the {limits.max_bytes} allowed")
    return path.read_bytes()


def decode_image(data: bytes, *, limits: ImageLimits) -> Image:
    """Check encoded image bytes (size, format, structure) without decoding the pixels."""
    from PIL import Image as PILImage

    if len(data) > limits.max_bytes:
        raise ImageProblem(f"image is {len(data)} bytes, more than the {limits.max_bytes} allowed")
    try:
        with PILImage.open(io.BytesIO(data)) as im:
            fmt, (width, height) = im.format, im.size
            if fmt in IMAGE_FORMATS and width * height <= limits.max_pixels:
                im.verify()
    except Exception as err:  # Pillow raises many types for a bad file (OSError, SyntaxError, bombs...)
        raise ImageProblem(f"image bytes cannot be decoded: {type(err).__name__}: {err}") from None
    if fmt not in IMAGE_FORMATS:
        raise ImageProblem(f"image format {fmt} is not one of {', '.join(IMAGE_FORMATS)}")
    if width * height > limits.max_pixels:
        raise ImageProblem(
            f"image is {width}x{height} = {width * height} pixels, more than the {limits.max_pixels} allowed"
        )
    return Image(data=data, format=fmt, width=width, height=height)


def count_placeholders(messages: list[dict[str, Any]]) -> int:
    """How many ``<image>`` placeholders the messages' text holds."""
    return sum(str(m.get("content", "")).count(IMAGE_PLACEHOLDER) for m in messages)


def check_placeholders(messages: list[dict[str, Any]], num_images: int) -> None:
    """Raise unless the messages hold exactly one ``<image>`` per image."""
    found = count_placeholders(messages)
    if found != num_images:
        raise ImageProblem(
            f"the prompt has {found} `{IMAGE_PLACEHOLDER}` placeholders but the row has {num_images} images"
        )


def data_url(image: Image) -> str:
    """``image`` as a ``data:`` URL, as vLLM's ``content_parts`` and OpenAI image parts take it (no network)."""
    import base64

    return f"data:{image.mime_type};base64,{base64.b64encode(image.data).decode('ascii')}"


class ImageTokens(msgspec.Struct, frozen=True, kw_only=True):
    """How many prompt tokens an image becomes on a Qwen2-VL-family model: its processor resizes it to a
    multiple of ``patch * merge`` pixels a side within [min_pixels, max_pixels] and the server expands its
    pad to one token per merged patch, so a prompt's length is known before any request (the rollouter's
    ``data.max_prompt_tokens`` check counts them)."""

    patch: int = 14
    merge: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @classmethod
    def from_model(cls, path: str | Path) -> ImageTokens | None:
        """The model's image processor settings (``preprocessor_config.json``), or None without one."""
        import json

        file = Path(path).expanduser() / "preprocessor_config.json"
        if not file.is_file():
            return None
        cfg = json.loads(file.read_text())
        size = cfg.get("size") or {}
        return cls(
            patch=int(cfg.get("patch_size", 14)),
            merge=int(cfg.get("merge_size", 2)),
            min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels),
            max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or cls.max_pixels),
        )

    def count(self, image: Image) -> int:
        """Tokens ``image`` takes in the prompt (its pad expanded), by the processor's own resize."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        factor = self.patch * self.merge
        h, w = smart_resize(image.height, image.width, factor, self.min_pixels, self.max_pixels)
        return (h // factor) * (w // factor)


def content_parts(images: list[Image]) -> list[dict[str, str]]:
    """``images`` as vLLM's native route takes them (``content_parts``: data URLs, no network), in order."""
    return [{"type": "image_url", "url": data_url(image)} for image in images]


# Agent loops that send a sample's images with its prompt (the others would render `<image>` as text).
IMAGE_AGENTS = ("single_turn",)


def images_refused(backend: str, route: str) -> str | None:
    """Why rollout ``backend`` (vLLM's ``route``) takes no images, or None where it does (vLLM's native
    route only)."""
    if backend != "vllm":
        return (
            f"rollout.backend `{backend}` takes no images (the embedded server runs text models; SGLang's "
            "client sends none): use rollout.backend=vllm with rollout.vllm.route=generate"
        )
    if route != "generate":
        return "vLLM's /v1/completions takes no images: set rollout.vllm.route=generate"
    return None


def group_images(images: list[Image], trajectories: list[Any]) -> list[bytes]:
    """The encoded images a group carries once (every trajectory's prompt holds their pads): the sample's
    ``images``, or, for a text sample, those its trajectories (``AgentLoopOutput``s, segments included) got
    from their requests (the gateway's image parts), which must then be the same in each. ValueError
    naming the first trajectory that differs."""
    if images:
        return [image.data for image in images]
    first = [image.data for image in trajectories[0].images] if trajectories else []
    for i, out in enumerate(trajectories):
        if [image.data for image in out.images] != first:
            raise ValueError(
                f"trajectory {i} sent other images than trajectory 0 ({len(out.images)} against {len(first)}): "
                "a group carries one list of images, so its episodes must send the same ones"
            )
    return first


def images_not_served(samples: list[Any], *, backend: str, route: str, agent: str) -> str | None:
    """Why a run with rollout ``backend`` (vLLM's ``route``) and agent loop ``agent`` cannot train on
    ``samples`` (``Sample``s), or None. Images reach vLLM's native route only: the embedded server and
    SGLang's client take none, and /v1/completions has no image field, so image prompts would otherwise be
    generated (and trained) as text."""
    with_images = [s.index for s in samples if s.images]
    if not with_images:
        return None
    have = f"{len(with_images)} of {len(samples)} prompts have images (the first: prompt {with_images[0]})"
    if refused := images_refused(backend, route):
        return f"{have}, but {refused}"
    if agent not in IMAGE_AGENTS:
        return f"{have}, but agent loop `{agent}` sends no images (only {', '.join(IMAGE_AGENTS)} does)"
    return None
