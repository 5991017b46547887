"""Whole-system tools: what runs every role together rather than being one.

* ``e2e.py`` — ``slipstream bench e2e``: samples/s of ``fully_async`` against ``sync`` on a long-tail
  workload, the pipeline launched as ``slipstream train`` launches it;
* ``scale.py`` — ``slipstream bench scale``: the control plane (queue, rollouter, balancer, pushes) at 8 to
  256 inference servers, simulated by ``sim_servers.py``;
* ``bench_train.py`` — ``slipstream bench train``'s command: the measurement is ``trainer/bench.py``, the
  options and each mode's settings come from a run's config, which no role imports;
* ``bench_queue.py``, ``bench_rollout.py``, ``bench_gateway.py``, ``bench_logprob.py`` — ``slipstream bench
  queue|rollout|gateway|logprob``: one role measured alone (the queue against Ray and memcpy, the embedded
  server against ``generate``, the agent gateway's overhead, chunked logprobs' peak memory);
* ``bench_weightsync.py`` — ``slipstream bench weightsync``: ``--target processes`` runs
  ``bench_transport.py`` (the transports between processes, with ``bench_send_less.py``'s send-less figures
  for ``--send-less``), ``--target vllm`` a push into a generating vLLM server;
* ``soak.py`` — ``slipstream bench soak``: a long run with servers and trainer ranks killed, memory and lost
  groups accounted;
* ``sim_servers.py`` — many model-less SGLang-style HTTP servers in one process, for ``scale.py`` and tests;
* ``gpucheck/`` — ``scripts/gpu_check.sh``: the staged checks a GPU machine runs, and their CPU rehearsal.

The roles never import this package; it imports them (``docs/architecture.md``, "Layout and import rules").
"""
