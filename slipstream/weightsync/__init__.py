"""Weight sync: bucketed, pipelined weight pushes from trainer rank 0 to the inference servers.

One abstraction moves bytes everywhere, in production, benches and tests alike: a
:class:`~slipstream.weightsync.base.Transport` (``base.py``), one end of which is the sender and one each
receiver. ``prepare()`` gives a msgspec ``Rendezvous``, :func:`~slipstream.weightsync.base.build_topology`
gives every end its ``InitInfo``, ``connect(info)`` joins them, then per version ``send_weights`` packs the
tensors into buckets (``buckets.py``) double-buffered, and each receiver stages the whole version before
``load``-ing it at once (:func:`~slipstream.weightsync.base.receive_version`). Transports, registered in
``TRANSPORTS`` by ``weightsync.backend``: ``torch_dist`` (gloo / NCCL groups), ``ipc`` (one host: shared
memory, CUDA IPC), ``nixl`` (NIXL READs), ``nccl_uid`` (the sending end of vLLM's own NCCL engine).

Trainer side: :class:`~slipstream.weightsync.publisher.WeightPublisher` (behind the trainer's publish hook)
picks a transport for its servers and opens it with them (``servers.py``), then drives each server through
its adapter (the base in ``adapters.py``; each server kind's subclass, SGLang, vLLM and our embedded server,
is part of its record in ``slipstream.serverkinds``, which the caller hands the publisher: weight sync never
looks a kind up by name).
Serving side: :func:`~slipstream.weightsync.http_receiver.build_router` gives any server whose engine is a
:class:`~slipstream.weightsync.types.WeightTarget` SGLang's weight-update routes over receiving ends of the
same transports. A receiver in another program (a vLLM worker plug-in) uses an end directly:
``make_transport(name, cfg, is_sender=False)``, ``prepare()`` (as msgpack bytes), ``connect(InitInfo)``,
``receive_version(end, load)``. Wire types are msgspec Structs in ``types.py``. This package imports no
other role.

To add a transport: one module with a ``Transport`` subclass registered in ``TRANSPORTS`` (the steps are in
``base.py``'s docstring), the name in ``TransportName`` and ``WeightSyncConfig.backend``, and, if servers join
it over HTTP, its ``joins`` (a *group* joined through the server's init call, or a *stream* through
``/weightsync/<name>/prepare`` and ``/connect``, whose name the servers' ``http_receiver.STREAMS`` also lists).
"""
