"""`scripts/gpu_check.sh`: what only a GPU can prove, in one short call, rehearsed on a CPU.

Stage 1 (no Ray, no NIXL; one call of <= 420 s on one H100, limits adding up to 390 s):

* ``preflight``: every Slipstream module imports (those that need Ray, NIXL or a server package are listed,
  not failed), the versions that matter, the device and driver;
* ``gpu_tests``: every test marked ``gpu`` with junit output (``OUT/gpu_tests.xml``);
* ``weightsync_ipc``: the ipc engine between two processes on one GPU (CUDA IPC), the 1.17B bf16 set with
  random values, each version's digest compared on the receiver, beside one device copy of the same bytes
  (``weightsync_cuda_ipc_gbps``, ``weightsync_ipc_copy_gbps``);
* ``push``: one version from an FSDP2 engine through the real publisher path into an embedded server on the
  same GPU, with the config's default push dtype (``push_bytes_per_param``), ``full_tensor`` and the cast;
* ``train_16k`` / ``train_32k``: a training step of the 1.17B / 49,152-vocab shape on a packed 16K-token batch
  (``trainer_mfu_1b``) and on one 32K-token response (``long_32k_peak_gb``), chunked logprobs counted;
* ``rollout``: the embedded server against eager and static-cache ``generate`` with a KV cache that holds the
  workload (``embedded_vs_generate_64``, ``embedded_vs_generate_256``) and its logprob error
  (``embedded_logprob_err_bf16``).

Stage 2 (``--stage 2``, when device time is left; Ray and NIXL carried): ``nixl_weightsync`` and
``one_gpu_train`` (``slipstream train`` on one GPU, colocated, ``one_gpu_train_steps``).

Each check runs in a process group of its own and writes its result to ``OUT/results.json`` the moment it
ends (runner.py). ``--small`` (implied by ``--device cpu``) runs the same code at small shapes: the rehearsal
(``scripts/gpu_check.sh --rehearse DIR``, rehearse.py) does that in an environment with the GPU image's
package versions plus exactly the carried wheels (carry.py).
"""

from slipstream.system.gpucheck import checks, stage2  # noqa: F401  (register the checks)
from slipstream.system.gpucheck.runner import CHECKS, main, run_one

__all__ = ["CHECKS", "main", "run_one"]
