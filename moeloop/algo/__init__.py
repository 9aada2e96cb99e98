"""moeloop.algo: advantage estimators, KL estimators, policy/value losses and loss aggregation."""
from moeloop.algo.advantages import ADV_ESTIMATORS, compute_advantages
from moeloop.algo.aggregation import LOSS_AGG_MODES, aggregate_loss, loss_denominator
from moeloop.algo.dapo import filter_uniform_groups, overlong_penalty
from moeloop.algo.kl import KL_ESTIMATORS, kl_estimate
from moeloop.algo.losses import PolicyInputs, actor_loss, reduce_metrics, value_loss
from moeloop.algo.token_rewards import apply_kl_in_reward, token_rewards

__all__ = [
    "ADV_ESTIMATORS", "compute_advantages", "LOSS_AGG_MODES", "aggregate_loss", "loss_denominator",
    "filter_uniform_groups", "overlong_penalty", "KL_ESTIMATORS", "kl_estimate", "PolicyInputs",
    "actor_loss", "reduce_metrics", "value_loss", "apply_kl_in_reward", "token_rewards",
]
