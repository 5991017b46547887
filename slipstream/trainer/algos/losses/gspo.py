"""GSPO: group sequence policy optimisation (a sequence-level, length-normalised ratio).

Zheng et al., "Group Sequence Policy Optimization" (arXiv 2507.18071), Eqs. 5-7, in verl's token form:

    s_i      = exp( (1/|y_i|) * sum_t log(pi_theta / pi_old)(y_i,t) )          (the sequence ratio)
    s_i,t    = sg[s_i] * pi_theta(y_i,t) / sg[pi_theta(y_i,t)]                 (same value, token gradient)
    L_i,t    = max(-A * s_i,t, -A * clip(s_i,t, 1 - clip_low, 1 + clip_high))

aggregated with the configured ``loss_agg_mode``, as verl does (the paper's form is ``seq-mean-token-mean``:
set it in a GSPO config). The paper's clip ranges
are tiny (3e-4 / 4e-4) because s_i is a geometric mean; set ``clip_low``/``clip_high`` accordingly.
"""

from __future__ import annotations

import torch

from slipstream.trainer.algos.losses import POLICY_LOSSES, PolicyLossInputs, PolicyLossOutput
from slipstream.trainer.algos.segments import segment_sum


@POLICY_LOSSES.register("gspo")
def gspo(inp: PolicyLossInputs) -> PolicyLossOutput:
    mask = inp.mask.to(inp.logp.dtype)
    per_tok = inp.logp - inp.old_logp
    lengths = segment_sum(mask, inp.seg, inp.num_seqs).clamp(min=1)
    seq_log_ratio = segment_sum(per_tok * mask, inp.seg, inp.num_seqs) / lengths
    log_s = inp.logp - inp.logp.detach() + seq_log_ratio.detach()[inp.seg]
    ratio = torch.exp(torch.clamp(log_s, max=10.0))
    loss1 = -inp.advantages * ratio
    loss2 = -inp.advantages * torch.clamp(ratio, 1.0 - inp.clip_low, 1.0 + inp.clip_high)
    return PolicyLossOutput(torch.maximum(loss1, loss2), (loss2 > loss1).float())
