"""The data that flows through the queue: trajectories and the groups they travel in.

A :class:`Trajectory` is what an agent loop produces for one sample: token ids in and out, which tokens the
policy generated (``loss_mask``), the behaviour log-probabilities and the weight version of every response
token, and a reward. Token ids are kept exactly as the inference server produced them (never re-tokenised).

A *group* is the ``n`` trajectories of one prompt. GRPO-style estimators need whole groups, so the queue
only ever moves whole groups. On the wire and in the queue a group is *columnar*: per-sample metadata in a
msgspec header (:class:`GroupMeta`) and the token-level columns concatenated across samples into one
tensor each (:class:`TrajectoryGroup`), so a group is a handful of frames however many samples it holds.

A group's :class:`Provenance` is the rollouter-to-trainer contract that rides with it: which prompt (index,
epoch) it answers, how many of that prompt's groups were dropped as too stale before it, and whether the
trainer must keep it whatever its staleness. The rollouter writes it (``Rollouter._generate_group``), the
trainer reads ``keep_stale`` (``Trainer._lease_batch``) and the rollouter reads the rest back when the trainer
drops the group (``Rollouter._collect_dropped``). It is versioned twice over: the struct carries its schema
number as a tag (``PROVENANCE_SCHEMA``; fields are only ever appended, with defaults, so an older reader
skips newer ones), and queue snapshots written before it existed, whose groups carried a free-form
``extra`` map instead, are read through ``LegacyGroupMeta`` (``queue/snapshot.py``).

A sample's :class:`SampleOutcome` is the per-sample counterpart: why its reward call failed and which
earlier segment of an agent episode it is. It sits where sample headers once carried a free-form ``extra``
map and is encoded as a map itself, so those older headers decode into it (its docstring says how).

Invariants of a :class:`TrajectoryGroup` (checked by :meth:`TrajectoryGroup.validate`):
  * ``tensors["prompt_ids"]`` has ``sum(s.prompt_len)`` int32 entries;
  * ``response_ids`` (int32), ``loss_mask`` (uint8), ``logprobs`` (float32) and ``versions`` (int32) have
    ``sum(s.response_len)`` entries each, sample after sample in ``meta.samples`` order;
  * ``prompt_routes`` and ``response_routes`` (MoE routing replay) come together, prompt- and response-aligned,
    ``[rows, layers, k]`` uint8 (255: unknown) or int16 (-1: unknown);
  * ``images`` (vision-language prompts), optional: the group's encoded images end to end, uint8 with
    ``sum(meta.image_nbytes)`` entries; they are the prompt's, so they travel once per group, whatever ``n``;
  * extra tensors a producer adds are response-aligned (first dimension ``sum(s.response_len)``).

Worked example::

    trajs = [Trajectory(uid=f"p7-{i}", group_id="p7", prompt_ids=[1, 2], response_ids=[5, 6, 2],
                        loss_mask=[1, 1, 1], logprobs=[-0.1, -0.5, -0.2], versions=[3, 3, 4], reward=1.0)
             for i in range(4)]
    group = TrajectoryGroup.from_trajectories(trajs, Provenance(prompt_index=7, data_source="gsm8k"))
    group.min_version        # 3
    group.to_trajectories() == trajs   # True
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

PROMPT_COLUMNS = ("prompt_ids",)
RESPONSE_COLUMNS = ("response_ids", "loss_mask", "logprobs", "versions")
# MoE routing replay, optional (both or neither): each token's experts [tokens, layers, k], the prompt's rows
# and the response's. uint8 with 255 for "unknown" (the last token, which no forward saw) when every expert
# id is below 255, else int16 with -1.
ROUTE_COLUMNS = ("prompt_routes", "response_routes")
PROMPT_ALIGNED = (*PROMPT_COLUMNS, "prompt_routes")
# The group's images (its prompt's), encoded as stored (PNG, JPEG, WebP) and laid end to end; the header's
# ``image_nbytes`` cuts them. One copy per group: every sample of a group answers the same prompt.
IMAGE_COLUMN = "images"
UNKNOWN_ROUTE = {torch.uint8: 255, torch.int16: -1}
COLUMN_DTYPES: dict[str, torch.dtype] = {
    "prompt_ids": torch.int32,
    "response_ids": torch.int32,
    "loss_mask": torch.uint8,
    "logprobs": torch.float32,
    "versions": torch.int32,
}


class SampleOutcome(msgspec.Struct, omit_defaults=True, frozen=True, gc=False):
    """What became of one sample besides its reward; the default is a whole episode that scored normally.

    The rollouter writes it (``Rollouter._trajectory``) and reads ``reward_error`` back when it filters
    groups (``Rollouter._informative``). Unlike its neighbours it is encoded as a map, not an array: it
    holds the slot of :class:`SampleMeta` that carried the free-form ``extra`` map before it, so a header
    written then (a queue snapshot, an older client's put) decodes into it: the map's ``reward_error`` and
    ``segment`` keys are these fields, and its other keys, ``data_source`` and ``prompt_index``, repeated the
    group's :class:`Provenance` and are skipped. Fields are only ever added, with defaults; a sample that
    has none but defaults costs one byte (``{}``).

    Worked example: a sample whose reward call timed out is
    ``SampleOutcome(reward_error="reward service: no score within reward.timeout_s=60")``; the first earlier
    segment of an agent episode that scored normally is ``SampleOutcome(segment=0)``."""

    # Why the reward could not be computed (``RewardResult.error``; "": it was); the sample's reward is then
    # the failure score.
    reward_error: str = ""
    # Index of this earlier segment of its agent episode (``Trajectory.episode``); -1: not an earlier
    # segment (a whole episode, or an episode's own trajectory, its last segment).
    segment: int = -1


class Trajectory(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """One sample: a prompt and everything generated after it (all turns, tool output included)."""

    uid: str
    group_id: str
    prompt_ids: list[int]
    # Every token after the prompt: policy tokens (loss_mask 1) and tool/environment tokens (loss_mask 0).
    response_ids: list[int]
    loss_mask: list[int]
    # Behaviour-policy log-probability of each response token (0.0 where loss_mask is 0).
    logprobs: list[float]
    # Weight version that generated each response token (tool tokens carry the version of the turn before).
    versions: list[int]
    reward: float = 0.0
    # Named parts of the reward (e.g. {"format": 0.1, "correct": 1.0}); `reward` is what is trained on.
    reward_components: dict[str, float] = {}
    # stop | length | abort | error
    finish_reason: str = "stop"
    num_turns: int = 1
    metrics: dict[str, float] = {}
    # A failed reward call, an earlier segment of an episode; the default for a whole, normally scored one.
    outcome: SampleOutcome = SampleOutcome()
    # An earlier segment of an agent episode (a harness that compacted or edited its history): the uid of the
    # episode's own trajectory, its last segment. Empty: this trajectory is a whole episode. Segments train as
    # sequences of their own, but group statistics count the episode once.
    episode: str = ""
    # MoE routing replay: the experts the server routed each token but the last to, an integer array
    # ``[len(prompt_ids) + len(response_ids) - 1, layers, k]`` (numpy or torch; vLLM's layout, -1 where
    # unknown); None without routes. In the queue it travels as the ``*_routes`` columns, never pickled.
    routed_experts: Any = None

    def validate(self) -> None:
        n = len(self.response_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"trajectory {self.uid}: `{name}` has {len(getattr(self, name))} entries, "
                    f"`response_ids` has {n}"
                )
        if self.routed_experts is not None:
            want = len(self.prompt_ids) + n - 1
            shape = tuple(self.routed_experts.shape)
            if len(shape) != 3 or shape[0] != want:
                raise ValueError(
                    f"trajectory {self.uid}: `routed_experts` has shape {shape}, expected [{want}, layers, k] "
                    f"(one row per prompt and response token but the last): routes that do not match the "
                    f"tokens would replay the wrong experts"
                )

    @property
    def min_version(self) -> int:
        """Oldest weight version among the tokens (-1 when the response is empty)."""
        return min(self.versions) if self.versions else -1


class SampleMeta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Per-sample header of a group on the wire; the token columns travel as tensors."""

    uid: str
    prompt_len: int
    response_len: int
    min_version: int
    max_version: int
    reward: float = 0.0
    reward_components: dict[str, float] = {}
    finish_reason: str = "stop"
    num_turns: int = 1
    metrics: dict[str, float] = {}
    outcome: SampleOutcome = SampleOutcome()  # where older headers have their ``extra`` map (SampleOutcome)
    episode: str = ""  # Trajectory.episode (last: headers stored before it decode with the default)


PROVENANCE_SCHEMA = 1


class Provenance(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True, gc=False,
                 tag=PROVENANCE_SCHEMA):  # fmt: skip
    """Where a group came from (module docstring); on the wire ``[schema, prompt_index, epoch, ...]``.

    Worked example: the second group generated for prompt 12 of epoch 1, after the first was dropped as
    too stale, is ``Provenance(prompt_index=12, epoch=1, attempt=1, data_source="gsm8k")``."""

    # Index of the prompt in the rollouter's prompt source (``PromptSource.get``).
    prompt_index: int
    # Pass over the prompt source the prompt was drawn in (0 for the first).
    epoch: int = 0
    # Groups of this prompt the trainer dropped as too stale before this one (``async.max_stale_drops``).
    attempt: int = 0
    # The prompt's ``data_source`` (which reward function scored it).
    data_source: str = ""
    # Dropped ``max_stale_drops`` times already: the trainer trains it whatever its staleness.
    keep_stale: bool = False


class GroupMeta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Header of one group: its id, its samples, and where it came from (None: not made by a rollouter,
    e.g. a benchmark's or a test's group)."""

    group_id: str
    samples: list[SampleMeta]
    provenance: Provenance | None = None
    # Bytes of each of the prompt's images in the ``images`` column, in placeholder order (none: a text
    # prompt). Last, with a default: headers stored before it decode unchanged.
    image_nbytes: list[int] = []

    @property
    def keep_stale(self) -> bool:
        return self.provenance is not None and self.provenance.keep_stale


@dataclass
class TrajectoryGroup:
    """The ``n`` trajectories of one prompt in columnar form; the unit of ``put`` and ``lease``.

    Tensors returned by a lease may be read-only views of received buffers: treat them as read-only and
    copy what you keep past the ack (:func:`slipstream.queue.batch.collate` copies).
    """

    meta: GroupMeta
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    # Set by ``QueueClient.alloc_group``: where these tensors already lie in the queue's shared memory, so
    # ``put`` copies nothing. Cleared by that put.
    placement: Any = field(default=None, repr=False, compare=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_trajectories(
        cls,
        trajectories: list[Trajectory],
        provenance: Provenance | None = None,
        images: list[bytes] | tuple[bytes, ...] = (),
    ) -> TrajectoryGroup:
        """The group of ``trajectories``; ``images``: their prompt's encoded images, stored once."""
        if not trajectories:
            raise ValueError("a group needs at least one trajectory")
        group_id = trajectories[0].group_id
        samples = []
        for t in trajectories:
            t.validate()
            if t.group_id != group_id:
                raise ValueError(f"trajectory {t.uid} has group_id {t.group_id!r}, expected {group_id!r}")
            versions = t.versions or [-1]
            samples.append(
                SampleMeta(
                    uid=t.uid,
                    prompt_len=len(t.prompt_ids),
                    response_len=len(t.response_ids),
                    min_version=min(versions),
                    max_version=max(versions),
                    reward=float(t.reward),
                    reward_components=t.reward_components,
                    finish_reason=t.finish_reason,
                    num_turns=t.num_turns,
                    metrics=t.metrics,
                    outcome=t.outcome,
                    episode=t.episode,
                )
            )
        tensors = {
            name: torch.tensor([x for t in trajectories for x in getattr(t, name)], dtype=dtype)
            for name, dtype in COLUMN_DTYPES.items()
        }
        tensors.update(_route_columns(trajectories))
        meta = GroupMeta(group_id=group_id, samples=samples, provenance=provenance)
        if images:
            meta.image_nbytes = [len(im) for im in images]
            tensors[IMAGE_COLUMN] = torch.frombuffer(bytearray(b"".join(images)), dtype=torch.uint8)
        group = cls(meta, tensors)
        group.validate()
        return group

    def to_trajectories(self) -> list[Trajectory]:
        out = []
        p_off = r_off = 0
        cols = {name: self.tensors[name].tolist() for name in COLUMN_DTYPES}
        routes = _sample_routes(self.tensors, self.meta.samples) if "prompt_routes" in self.tensors else None
        for i, s in enumerate(self.meta.samples):
            p_end, r_end = p_off + s.prompt_len, r_off + s.response_len
            out.append(
                Trajectory(
                    uid=s.uid,
                    group_id=self.meta.group_id,
                    prompt_ids=cols["prompt_ids"][p_off:p_end],
                    response_ids=cols["response_ids"][r_off:r_end],
                    loss_mask=cols["loss_mask"][r_off:r_end],
                    logprobs=cols["logprobs"][r_off:r_end],
                    versions=cols["versions"][r_off:r_end],
                    reward=s.reward,
                    reward_components=s.reward_components,
                    finish_reason=s.finish_reason,
                    num_turns=s.num_turns,
                    metrics=s.metrics,
                    outcome=s.outcome,
                    episode=s.episode,
                    routed_experts=None if routes is None else routes[i],
                )
            )
            p_off, r_off = p_end, r_end
        return out

    # ------------------------------------------------------------------ views
    @property
    def group_id(self) -> str:
        return self.meta.group_id

    @property
    def uids(self) -> list[str]:
        return [s.uid for s in self.meta.samples]

    @property
    def num_samples(self) -> int:
        return len(self.meta.samples)

    @property
    def min_version(self) -> int:
        """Oldest weight version of any token in the group; staleness = trainer version - this."""
        return min(s.min_version for s in self.meta.samples)

    @property
    def images(self) -> list[bytes]:
        """The prompt's encoded images, in placeholder order (empty for a text prompt)."""
        if not self.meta.image_nbytes:
            return []
        data = self.tensors[IMAGE_COLUMN].numpy().tobytes()
        out, at = [], 0
        for n in self.meta.image_nbytes:
            out.append(data[at : at + n])
            at += n
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def validate(self) -> None:
        """Check the columnar invariants (see the module docstring); raise ValueError naming the column."""
        n_prompt = sum(s.prompt_len for s in self.meta.samples)
        n_resp = sum(s.response_len for s in self.meta.samples)
        for name in (*PROMPT_COLUMNS, *RESPONSE_COLUMNS):
            if name not in self.tensors:
                raise ValueError(f"group {self.group_id}: missing column `{name}`")
        if ("prompt_routes" in self.tensors) != ("response_routes" in self.tensors):
            raise ValueError(f"group {self.group_id}: `prompt_routes` and `response_routes` come together")
        for name in ROUTE_COLUMNS:
            routes = self.tensors.get(name)
            if routes is not None and (routes.dim() != 3 or routes.dtype not in UNKNOWN_ROUTE):
                raise ValueError(
                    f"group {self.group_id}: `{name}` must be [tokens, layers, k] uint8 or int16, "
                    f"got {routes.dtype} {tuple(routes.shape)}"
                )
        if "prompt_routes" in self.tensors:
            prompt, response = self.tensors["prompt_routes"], self.tensors["response_routes"]
            if (prompt.dtype, prompt.shape[1:]) != (response.dtype, response.shape[1:]):
                raise ValueError(
                    f"group {self.group_id}: `prompt_routes` is {prompt.dtype} {tuple(prompt.shape)} but "
                    f"`response_routes` is {response.dtype} {tuple(response.shape)}: a group's routes are of "
                    f"one model (layers, k) in one dtype"
                )
        n_image = sum(self.meta.image_nbytes)
        if n_image and IMAGE_COLUMN not in self.tensors:
            raise ValueError(
                f"group {self.group_id}: the header lists images but `{IMAGE_COLUMN}` is missing"
            )
        images = self.tensors.get(IMAGE_COLUMN)
        if images is not None and images.dtype != torch.uint8:
            raise ValueError(
                f"group {self.group_id}: column `{IMAGE_COLUMN}` is {images.dtype}, expected uint8"
            )
        for name, tensor in self.tensors.items():
            want = n_prompt if name in PROMPT_ALIGNED else n_image if name == IMAGE_COLUMN else n_resp
            if tensor.dim() == 0 or tensor.shape[0] != want:
                raise ValueError(
                    f"group {self.group_id}: column `{name}` has shape {tuple(tensor.shape)}, "
                    f"expected first dimension {want}"
                )
            expected = COLUMN_DTYPES.get(name)
            if expected is not None and tensor.dtype != expected:
                raise ValueError(
                    f"group {self.group_id}: column `{name}` is {tensor.dtype}, expected {expected}"
                )
        if len(set(self.uids)) != len(self.uids):
            raise ValueError(f"group {self.group_id}: duplicate uids within the group")


def _route_columns(trajectories: list[Trajectory]) -> dict[str, torch.Tensor]:
    """``prompt_routes`` / ``response_routes`` of a group whose trajectories carry routes (see the module
    docstring); {} when none does. A group with routes on some samples only is refused."""
    with_routes = [t.routed_experts is not None for t in trajectories]
    if not any(with_routes):
        return {}
    if not all(with_routes):
        missing = [t.uid for t, has in zip(trajectories, with_routes, strict=True) if not has]
        raise ValueError(f"trajectories {missing[:3]} carry no routed_experts while others of the group do")
    routes = [torch.as_tensor(t.routed_experts) for t in trajectories]
    if len({tuple(r.shape[1:]) for r in routes}) > 1:
        raise ValueError(f"group {trajectories[0].group_id}: routed_experts of different [layers, k] shapes")
    small = all(r.dtype == torch.uint8 and (r.numel() == 0 or int(r.max()) < 255) for r in routes)
    dtype = torch.uint8 if small else torch.int16
    prompt, response = [], []
    for t, r in zip(trajectories, routes, strict=True):
        unknown = torch.full((1, *r.shape[1:]), UNKNOWN_ROUTE[dtype], dtype=dtype)
        full = torch.cat([r.to(dtype), unknown])  # the last token: no forward saw it
        prompt.append(full[: len(t.prompt_ids)])
        response.append(full[len(t.prompt_ids) :])
    return {"prompt_routes": torch.cat(prompt), "response_routes": torch.cat(response)}


def _sample_routes(tensors: dict[str, torch.Tensor], samples: list[SampleMeta]) -> list[Any]:
    """Each sample's ``routed_experts`` (numpy, [prompt + response - 1, layers, k]) from the route columns."""
    out, p_off, r_off = [], 0, 0
    prompt, response = tensors["prompt_routes"], tensors["response_routes"]
    for s in samples:
        p_end, r_end = p_off + s.prompt_len, r_off + s.response_len
        full = torch.cat([prompt[p_off:p_end], response[r_off:r_end]])
        out.append(full[:-1].numpy().copy())
        p_off, r_off = p_end, r_end
    return out
