"""Whole-system tools: what runs every role together rather than being one.

* ``e2e.py`` — ``slipstream bench e2e``: samples/s of ``fully_async`` against ``sync`` on a long-tail
  workload, the pipeline launched as ``slipstream train`` launches it;
* ``scale.py`` — ``slipstream bench scale``: the control plane (queue, rollouter, balancer, pushes) at 8 to
  256 inference servers, simulated by ``sim_servers.py``;
* ``bench_train.py`` — ``slipstream bench train``'s command: the measurement is ``trainer/bench.py``, the
  options and each mode's settings come from a run's config, which no role imports;
* ``soak.py`` — ``slipstream bench soak``: a long run with servers and trainer ranks killed, memory and lost
  groups accounted;
* ``sim_servers.py`` — many model-less SGLang-style HTTP servers in one process, for ``scale.py`` and tests;
* ``gpucheck/`` — ``scripts/gpu_check.sh``: the staged checks a GPU machine runs, and their CPU rehearsal.

The roles never import this package; it imports them (``docs/architecture.md``, "Layout and import rules").
"""
