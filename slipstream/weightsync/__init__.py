"""The checkpoint engine: bucketed, pipelined weight pushes from trainer rank 0 to the inference servers.

Trainer side: :class:`~slipstream.weightsync.publisher.WeightPublisher` (behind the trainer's publish hook)
drives each server through its adapter (``adapters.py``: SGLang, vLLM, our embedded server, as described
in ``slipstream.serverapi``)
around a data plane (``links.py``). Serving side: :func:`~slipstream.weightsync.http_receiver.build_router`
gives any server whose engine is a :class:`~slipstream.weightsync.types.WeightTarget` SGLang's weight-update
routes, staging each version and applying it whole. Underneath, the :class:`~slipstream.weightsync.base.
CheckpointEngine` backends (``torch_dist``, ``naive``, ``nixl``; see ``base.py`` for how to add one) and the
bucket layouts (``buckets.py``). Wire types are msgspec Structs in ``types.py``. This package imports no
other role.
"""
