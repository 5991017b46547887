"""Image content parts of chat messages: data URLs decoded and checked, every other URL refused.

OpenAI chat messages carry images as content parts ``{"type": "image_url", "image_url": {"url": ...}}``. The
gateway takes ``data:`` URLs only (``data:image/png;base64,...``, PNG, JPEG or WebP): it fetches nothing
from the network, so a harness that wants a remote picture downloads it and sends its bytes. Each image is
checked as a dataset's images are (:mod:`slipstream.agents.multimodal`: bytes and pixels within
:class:`ImageLimits`, one of ``IMAGE_FORMATS``, its structure verified by Pillow without decoding the pixels),
a request carries at most ``ImageLimits.max_images`` of them (its whole history counted), and every refusal
is a 400 naming the message and the part. The bytes are kept as sent (never re-encoded) and go to the server
as data URLs again, the way the rollouter sends a dataset's images.

Runs in a worker thread with the rendering: decoding base64 and reading an image's header take time
proportional to the body (at most ``MAX_REQUEST_BYTES``), which on the event loop would stall every session.

Worked example::

    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo..."}}
    chat_images([{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}], ImageLimits())
    # [Image(data=b"\\x89PNG...", format="PNG", width=112, height=112)]
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from typing import Any

from slipstream.agents.gateway.checks import GatewayError, part_url
from slipstream.agents.multimodal import MIME_TYPES, Image, ImageLimits, ImageProblem, decode_image

# The token each image renders to in the prompt, one per image, which the server expands (Qwen2-VL family).
IMAGE_PAD = "<|image_pad|>"


def image_parts(content: Any) -> list[dict[str, Any]]:
    """The image parts of a message's content (none for string content)."""
    if not isinstance(content, list):
        return []
    return [p for p in content if isinstance(p, dict) and p.get("type") == "image_url"]


def image_key(part: dict[str, Any]) -> str:
    """What identifies an image part when two histories are compared (a digest of its URL)."""
    return hashlib.sha256(str(part_url(part)).encode()).hexdigest()


def chat_images(messages: list[dict[str, Any]], limits: ImageLimits) -> list[Image]:
    """The images of ``messages``' image parts, decoded and checked, in order (400 naming the first bad one)."""
    images: list[Image] = []
    for i, m in enumerate(messages):
        for j, part in enumerate(m.get("content") if isinstance(m.get("content"), list) else []):
            if not (isinstance(part, dict) and part.get("type") == "image_url"):
                continue
            where = f"messages[{i}].content[{j}]"
            if len(images) >= limits.max_images:
                raise GatewayError(400, f"{where}: a request may carry at most {limits.max_images} images")
            images.append(_decode(part_url(part), where, limits))
    return images


def _decode(url: str, where: str, limits: ImageLimits) -> Image:
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0][:16] if ":" in url else "relative"
        raise GatewayError(
            400,
            f"{where}: only data: URLs are accepted (the gateway fetches nothing from the network), got a "
            f"{scheme} URL; send the image's bytes as data:image/png;base64,...",
        )
    head, comma, payload = url.partition(",")
    mime = head[len("data:") :].removesuffix(";base64")
    if not comma or not head.endswith(";base64"):
        raise GatewayError(400, f"{where}: the data URL must be base64 (data:image/png;base64,...)")
    if mime not in MIME_TYPES.values():
        raise GatewayError(
            400, f"{where}: media type {mime!r} is not one of {', '.join(MIME_TYPES.values())}"
        )
    if len(payload) // 4 * 3 > limits.max_bytes + 2:
        raise GatewayError(400, f"{where}: the image is over the {limits.max_bytes} bytes allowed")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise GatewayError(400, f"{where}: the data URL's base64 is malformed ({err})") from None
    try:
        return decode_image(data, limits=limits)
    except ImageProblem as err:
        raise GatewayError(400, f"{where}: {err}") from None
