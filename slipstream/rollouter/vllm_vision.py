"""Lets vLLM's CPU build serve Qwen2-VL-family models (images, not videos) where torchvision is not installed.

:func:`install` runs in every vLLM process through our ``vllm.general_plugins`` entry point
(``vllm_weights.register``), before vLLM inspects a model or loads its processor. ``make setup`` removes
torchvision because vLLM's CPU wheel pulls a CUDA build whose ops do not load against the CPU torch.
Without torchvision, two things stop a Qwen2-VL model (vLLM 0.32, transformers 5.19; docs/architecture.md
"Images on vLLM's CPU build"):

1. ``vllm/model_executor/models/qwen2_vl.py`` imports ``smart_resize`` from
   ``transformers.models.qwen2_vl.image_processing_qwen2_vl``, whose first lines import
   ``torchvision.transforms.v2``: model inspection fails with ``ModuleNotFoundError: No module named
   'torchvision'``. The PIL twin of that module, ``image_processing_pil_qwen2_vl``, has the same
   ``smart_resize`` and ``Qwen2VLImageProcessorPil`` and needs only Pillow and numpy: it is served under the
   torchvision module's name.
2. ``Qwen2VLProcessor.from_pretrained`` always loads a video processor, and transformers has Qwen2-VL's
   only with a torchvision backend: ``ValueError: ... requires `torchvision` to be installed``. A missing
   video processor becomes :class:`NoVideoProcessor`, which refuses any video with that reason; images go
   through the PIL image processor, which transformers already picks on its own.

Nothing happens until transformers imports one of those modules, so text models are untouched, and nothing
at all where torchvision imports. This follows transformers' internals named above: a transformers that
moves them makes the patch a no-op, and vLLM's own error then says what is missing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any, TypedDict

TORCHVISION_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
PIL_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
VIDEO_AUTO_MODULE = "transformers.models.auto.video_processing_auto"


class _NoKwargs(TypedDict, total=False):
    pass


class NoVideoProcessor(dict):
    """Stands for a video processor that cannot load here: a processor built with it takes images only.

    An empty ``dict`` so that the processor's own ``to_dict`` (which JSON-encodes every attribute that is not
    a transformers object) writes it as ``{}``.
    """

    # The keyword arguments it takes (none): read by the processor's call and by vLLM as a TypedDict.
    valid_kwargs = _NoKwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("videos need torchvision, which is not installed; this server takes images only")


def _patch_video_auto(module: Any) -> None:
    """Make ``AutoVideoProcessor.from_pretrained`` return :class:`NoVideoProcessor` where it would raise for
    want of torchvision, and let processors accept it."""
    from transformers import processing_utils

    auto = module.AutoVideoProcessor
    if getattr(auto, "_slipstream_no_video", False):  # vLLM may load its plug-ins twice in one process
        return
    auto._slipstream_no_video = True
    load = auto.from_pretrained.__func__

    def from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return load(cls, *args, **kwargs)
        except (ValueError, ImportError) as err:
            if "torchvision" not in str(err).lower():
                raise
            return NoVideoProcessor()

    auto.from_pretrained = classmethod(from_pretrained)
    check = processing_utils.ProcessorMixin.check_argument_for_proper_class

    def check_argument(self: Any, name: str, argument: Any) -> Any:
        if isinstance(argument, NoVideoProcessor):
            return NoVideoProcessor
        return check(self, name, argument)

    processing_utils.ProcessorMixin.check_argument_for_proper_class = check_argument


class _Finder(importlib.abc.MetaPathFinder):
    """Serves the PIL image-processor module under the torchvision one's name, and patches the video auto
    class once its module has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name == TORCHVISION_IMAGE_MODULE:
            return importlib.util.spec_from_loader(name, _AliasLoader())
        if name == VIDEO_AUTO_MODULE:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
            return spec
        return None


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return importlib.import_module(PIL_IMAGE_MODULE)

    def exec_module(self, module: Any) -> None:
        pass


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _patch_video_auto(module)


def install() -> bool:
    """Install the finder unless torchvision imports (then nothing is needed); True when installed."""
    if importlib.util.find_spec("torchvision") is not None:
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    if VIDEO_AUTO_MODULE in sys.modules:  # transformers imported it before the plug-ins ran
        _patch_video_auto(sys.modules[VIDEO_AUTO_MODULE])
    return True
