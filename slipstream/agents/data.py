"""Prompt datasets: verl-format parquet or jsonl files, checked row by row, served in a resumable order.

A dataset row has the fields verl uses, so datasets made for verl (and by ``slipstream data make``) load
unchanged::

    {"prompt": [{"role": "user", "content": "What is 3 + 4? Reply with only the number."}],
     "data_source": "arithmetic",
     "reward_model": {"style": "rule", "ground_truth": "7"},
     "extra_info": {"index": 0}}

Multi-modal rows add verl's ``images`` column and ``<image>`` placeholders in the prompt; each image is read
and checked as the row is (:mod:`slipstream.agents.multimodal`) and kept encoded in ``Sample.images``.

Every row is checked when the file is loaded, not when the rollouter first meets it hours into a run: a
missing or mistyped field raises one :class:`DatasetError` that names the file, the row and the field.

:class:`PromptSource` hands out the prompts epoch after epoch, shuffled per epoch from ``seed`` (the order
of epoch ``e`` depends only on ``seed`` and ``e``, so a position is two integers). Its ``state_dict`` is
that position; the rollouter saves it with the run's checkpoint.

Worked example::

    source = PromptSource.from_files(["train.parquet"], shuffle=True, epochs=2, seed=0)
    ref, sample = source.next()      # (PromptRef(epoch=0, index=13), Sample(index=13, ...))
    state = source.state_dict()      # {"epoch": 0, "offset": 1, "seed": 0, "size": 100, ...}
    source.load_state_dict(state)    # a new source resumes right after prompt 13
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

from slipstream.agents.multimodal import Image, ImageLimits, ImageProblem, check_placeholders, row_images

ROLES = ("system", "user", "assistant", "tool")


class DatasetError(ValueError):
    """A dataset file that cannot be used, naming the file, the row and the field."""


class Sample(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One prompt of a dataset and what its reward function needs to score a response."""

    # Position of the row in the (concatenated) dataset; stable across epochs.
    index: int
    # Chat messages ({"role": ..., "content": ...}) rendered by the chat template.
    messages: list[dict[str, Any]]
    # Selects the reward function (agents/rewards registry).
    data_source: str
    # The reference answer handed to the reward function (any JSON value).
    ground_truth: Any = None
    extra_info: dict[str, Any] = {}
    # The prompt's images in placeholder order, encoded as stored (empty for a text prompt). A default, so
    # records written before images existed decode unchanged.
    images: list[Image] = []


class PromptRef(msgspec.Struct, frozen=True):
    """Which prompt, in which epoch: enough to name a group and to find its prompt again."""

    epoch: int
    index: int


# ----------------------------------------------------------------------------------------------- loading


def load_samples(paths: Iterable[str | Path], *, image_limits: ImageLimits | None = None) -> list[Sample]:
    """Load and check every row of ``paths`` (``.parquet`` or ``.jsonl``), in order.

    Image paths in a file's ``images`` column are relative to that file's directory; ``image_limits``
    bounds each row's images (the defaults of :class:`ImageLimits` when None).
    """
    limits = image_limits or ImageLimits()
    samples: list[Sample] = []
    for path in paths:
        for row_number, row in _read_rows(Path(path)):
            samples.append(
                row_to_sample(
                    row,
                    index=len(samples),
                    where=f"{path}: row {row_number}",
                    base_dir=Path(path).parent,
                    image_limits=limits,
                )
            )
    if not samples:
        raise DatasetError(f"no rows in {', '.join(str(p) for p in paths) or 'the empty file list'}")
    return samples


def file_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be opened as a dataset file, or None when it can.

    A directory gets its own answer: "does not exist" would send people looking for a path that is there.
    """
    path = Path(path)
    if path.is_file():
        return None
    if path.is_dir():
        return "is a directory, not a data file; name the .parquet or .jsonl files in it"
    return "does not exist"


def _read_rows(path: Path) -> Iterable[tuple[int, Any]]:
    problem = file_problem(path)
    if problem:
        raise DatasetError(f"{path}: {problem}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises several unrelated types for a bad file
            raise DatasetError(f"{path}: not a readable parquet file: {err}") from None
        return enumerate(rows)
    if suffix in (".jsonl", ".json"):
        return _read_jsonl(path)
    raise DatasetError(f"{path}: unknown dataset format `{suffix}`; use .parquet or .jsonl")


def _read_jsonl(path: Path) -> Iterable[tuple[int, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rows.append((line_number - 1, json.loads(line)))
            except json.JSONDecodeError as err:
                raise DatasetError(
                    f"{path}: row {line_number - 1} (line {line_number}): not JSON: {err}"
                ) from None
    return rows


def row_to_sample(
    row: Any,
    *,
    index: int,
    where: str,
    base_dir: Path | None = None,
    image_limits: ImageLimits | None = None,
) -> Sample:
    """Check one verl-format row and turn it into a :class:`Sample`; ``where`` prefixes every error.

    A row with an ``images`` field (even null) must have one ``<image>`` placeholder per image; a row
    without one is text, whatever its prompt says.
    """
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a mapping of fields, got {type(row).__name__}")
    messages = _check_messages(_field(row, "prompt", where), where)
    data_source = _field(row, "data_source", where)
    if not isinstance(data_source, str) or not data_source:
        raise DatasetError(f"{where}: field `data_source` must be a non-empty string, got {data_source!r}")
    reward_model = _field(row, "reward_model", where)
    if not isinstance(reward_model, dict):
        raise DatasetError(
            f"{where}: field `reward_model` must be a mapping with `ground_truth`, got {type(reward_model).__name__}"
        )
    if "ground_truth" not in reward_model or reward_model["ground_truth"] is None:
        raise DatasetError(f"{where}: field `reward_model.ground_truth` is missing")
    extra_info = row.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, dict):
        raise DatasetError(f"{where}: field `extra_info` must be a mapping, got {type(extra_info).__name__}")
    images: list[Image] = []
    if "images" in row:
        try:
            images = row_images(row, base_dir=base_dir, limits=image_limits or ImageLimits())
            check_placeholders(messages, len(images))
        except ImageProblem as err:
            raise DatasetError(f"{where}: {err}") from None
    return Sample(
        index=index,
        messages=messages,
        data_source=data_source,
        ground_truth=reward_model["ground_truth"],
        extra_info=extra_info,
        images=images,
    )


def _field(row: dict[str, Any], name: str, where: str) -> Any:
    if name not in row or row[name] is None:
        raise DatasetError(f"{where}: field `{name}` is missing (fields present: {', '.join(sorted(row))})")
    return row[name]


def _check_messages(prompt: Any, where: str) -> list[dict[str, Any]]:
    # Parquet stores a list column as a numpy-free Python list after to_pylist(); jsonl gives a list too.
    if not isinstance(prompt, list) or not prompt:
        raise DatasetError(
            f"{where}: field `prompt` must be a non-empty list of chat messages, got {type(prompt).__name__}"
        )
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise DatasetError(
                f"{where}: field `prompt[{i}]` must be a mapping, got {type(message).__name__}"
            )
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise DatasetError(
                f"{where}: field `prompt[{i}].role` is {role!r}, expected one of {', '.join(ROLES)}"
            )
        if not isinstance(content, str):
            raise DatasetError(
                f"{where}: field `prompt[{i}].content` must be a string, got {type(content).__name__}"
            )
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages


# ----------------------------------------------------------------------------------------------- source


class PromptSource:
    """The prompts of a run in order: ``epochs`` passes, each shuffled from ``seed`` when ``shuffle``.

    Lifecycle: build once, call :meth:`next` until it returns None (all epochs served); :meth:`get` finds
    a prompt again by index (a group the trainer dropped as too stale is generated again).
    Invariant: the sequence of ``next()`` results depends only on (samples, shuffle, epochs, seed), so
    ``load_state_dict(state_dict())`` on a fresh source continues exactly where the old one was.
    """

    def __init__(self, samples: list[Sample], *, shuffle: bool = True, epochs: int = 1, seed: int = 0):
        if not samples:
            raise DatasetError("a prompt source needs at least one sample")
        if epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {epochs}")
        self.samples = samples
        self.shuffle = shuffle
        self.epochs = epochs
        self.seed = seed
        self._epoch = 0
        self._offset = 0
        self._order = self._epoch_order(0)

    @classmethod
    def from_files(
        cls, paths: Iterable[str | Path], *, shuffle: bool = True, epochs: int = 1, seed: int = 0
    ) -> PromptSource:
        return cls(load_samples(paths), shuffle=shuffle, epochs=epochs, seed=seed)

    @classmethod
    def from_config(cls, data_cfg: Any, *, seed: int = 0) -> PromptSource:
        """From a :class:`slipstream.agents.config.DataConfig` (its ``train_files``)."""
        if not data_cfg.train_files:
            raise DatasetError("data.train_files is empty: name at least one .parquet or .jsonl file")
        return cls.from_files(
            data_cfg.train_files, shuffle=data_cfg.shuffle, epochs=data_cfg.epochs, seed=seed
        )

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def total(self) -> int:
        """Prompts served over all epochs."""
        return len(self.samples) * self.epochs

    @property
    def served(self) -> int:
        return self._epoch * len(self.samples) + self._offset

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.samples)))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next(self) -> tuple[PromptRef, Sample] | None:
        """The next prompt, or None once every epoch has been served."""
        if self._offset >= len(self.samples):
            if self._epoch + 1 >= self.epochs:
                return None
            self._epoch += 1
            self._offset = 0
            self._order = self._epoch_order(self._epoch)
        index = self._order[self._offset]
        self._offset += 1
        return PromptRef(self._epoch, index), self.samples[index]

    def get(self, index: int) -> Sample:
        if not 0 <= index < len(self.samples):
            raise IndexError(
                f"prompt index {index} is out of range (the dataset has {len(self.samples)} rows)"
            )
        return self.samples[index]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "offset": self._offset,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "size": len(self.samples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position; refuses a state saved for a different dataset or order."""
        if state.get("size") != len(self.samples):
            raise ValueError(
                f"prompt state was saved for a dataset of {state.get('size')} rows, this one has {len(self.samples)}"
            )
        if state.get("seed") != self.seed or state.get("shuffle") != self.shuffle:
            raise ValueError(
                "prompt state was saved with a different order "
                f"(seed {state.get('seed')}, shuffle {state.get('shuffle')}; now {self.seed}, {self.shuffle})"
            )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if not (0 <= epoch < self.epochs and 0 <= offset <= len(self.samples)):
            raise ValueError(f"prompt state position (epoch {epoch}, offset {offset}) is out of range")
        self._epoch, self._offset = epoch, offset
        self._order = self._epoch_order(epoch)
