"""Every RL estimator and loss as a pure, ``jax.jit``-able function on ``[B, T]`` arrays.

Registries (names are verl's config values, so configs and results carry over):

* ``get_adv_estimator(name)`` — ``gae``, ``grpo``, ``grpo_passk``, ``rloo``, ``opo``, ``reinforce_plus_plus``,
  ``reinforce_plus_plus_baseline``, ``remax``, ``gpg``; add your own with
  ``@register_adv_estimator(name, needs=("index",))`` (``needs``: the batch inputs it cannot work without).
* ``get_policy_loss(name)`` — ``vanilla`` (PPO clip + clip-higher + dual-clip), ``gspo``, ``cispo``, ``gpg``;
  add your own with ``@register_policy_loss(name)``.
* ``kl_penalty(..., name)`` — ``KL_ESTIMATORS``; add your own with ``@register_kl_estimator(name)``.

The registries are the only list of valid names: the run config is checked against them, so a function
registered in a module given to ``launch/train.py --import`` is usable by name like a built-in.
"""

from jaxrl_hf.algos.advantages import (
    ADV_ESTIMATORS,
    adv_estimator_needs,
    adv_estimator_options,
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_adv_estimator,
    register_adv_estimator,
)
from jaxrl_hf.algos.aggregation import (
    LOSS_AGG_MODES,
    LossParts,
    agg_loss,
    agg_loss_denominator,
    agg_loss_parts,
    combine_loss_parts,
)
from jaxrl_hf.algos.dapo import compute_overlong_penalty, filter_groups, is_truncated, overlong_filter_mask
from jaxrl_hf.algos.kl import (
    KL_ESTIMATORS,
    KLControllerState,
    apply_kl_penalty,
    init_kl_controller,
    kl_penalty,
    register_kl_estimator,
    update_kl_controller,
)
from jaxrl_hf.algos.logits import entropy_from_logits, logprobs_from_logits, logsumexp_from_logits
from jaxrl_hf.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten
from jaxrl_hf.algos.policy_losses import (
    POLICY_LOSSES,
    compute_policy_loss_cispo,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_vanilla,
    get_policy_loss,
    policy_loss_needs,
    register_policy_loss,
)
from jaxrl_hf.algos.rollout_correction import (
    compute_mismatch_metrics,
    compute_rollout_is_weights,
    compute_rollout_rejection_mask,
)
from jaxrl_hf.algos.value_loss import compute_entropy_loss, compute_value_loss

__all__ = [name for name in dir() if not name.startswith("_")]
