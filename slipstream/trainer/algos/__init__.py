"""RL algorithms as pure tensor functions behind registries (style.md §2, §4).

Nothing here knows about ranks, engines or models: every function takes flat, packed tensors and returns
tensors, so the same code runs under FSDP, Megatron or a unit test.

  * ``advantages/``  estimators keyed by ``trainer.algorithm.adv_estimator`` (``ADVANTAGES``);
  * ``losses/``      policy losses keyed by ``trainer.algorithm.policy_loss`` (``POLICY_LOSSES``);
  * ``correction``   truncated importance sampling and rejection masks (``REJECTIONS``);
  * ``kl``           KL estimators k1/k2/k3 (``KL_ESTIMATORS``) and the entropy of logits;
  * ``aggregation``  loss aggregation modes, normalised over the global batch;
  * ``segments``     per-sample reductions on the packed token axis.

To add an algorithm, add one file to the matching sub-package and register it (see that package's
docstring); an unknown name in the config fails with the list of registered ones.
"""

from slipstream.trainer.algos.advantages import ADVANTAGES, AdvantageInputs, AdvantageOutput
from slipstream.trainer.algos.aggregation import AGG_MODES, aggregate, global_counts
from slipstream.trainer.algos.correction import REJECTIONS, truncated_is_weights
from slipstream.trainer.algos.kl import KL_ESTIMATORS, entropy_from_logits
from slipstream.trainer.algos.losses import POLICY_LOSSES, PolicyLossInputs, PolicyLossOutput

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "REJECTIONS",
    "AdvantageInputs",
    "AdvantageOutput",
    "PolicyLossInputs",
    "PolicyLossOutput",
    "aggregate",
    "entropy_from_logits",
    "global_counts",
    "truncated_is_weights",
]
