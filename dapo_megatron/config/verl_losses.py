"""verl's policy losses and rollout correction in our keys (`policy_loss.loss_mode`,
`algorithm.rollout_correction.*`), and the readers of a script's values that verl_compat.py shares:
each rule maps one verl value to our overrides, a ValueError refusing it with what to use instead.
"""
from __future__ import annotations

from typing import Callable

from dapo_megatron.algo import IS_LEVELS, POLICY_LOSSES, RS_CRITERIA


def bare(value: str) -> str:
    return value.strip().strip("'\"")


def is_true(value: str) -> bool:
    return bare(value).lower() in ("true", "1", "yes")


RC = "actor.rollout_correction."
# verl's first rejection API named the aggregation alone and bounded the ratio: our k1 criteria.
_OLD_RS = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
# verl's loss_mode -> the row of that name, with the aggregation it is defined with said aloud (verl
# forces seq-mean-token-mean on GSPO, its token form, and SAPO, and averages GMPO's sequences)
_LOSS_MODES = {"vanilla": ["actor.policy_loss=dapo"],
               "bypass_mode": ["actor.policy_loss=dapo", "actor.old_logprobs=rollout"],  # its ppo_clip form
               **{m: [f"actor.policy_loss={m}", *([f"actor.loss_agg_mode={POLICY_LOSSES[m].agg}"]
                                                   if POLICY_LOSSES[m].agg else [])]
                  for m in ("gspo", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov", "gpg", "dro", "dppo_tv",
                            "dppo_kl")}}


def is_null(value: str) -> bool:
    return bare(value).lower() in ("null", "none", "")


def _rollout_is(value: str) -> list[str]:
    """verl's level; its null said aloud is no correction (ours would otherwise weigh the tokens of an
    off-policy mode: actor.rollout_correction.is_level=auto)."""
    level = bare(value).lower()
    if is_null(level):
        return [f"{RC}is_level=none"]
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is={bare(value)} is not one of {', '.join(IS_LEVELS)} "
                         f"(actor.rollout_correction.is_level)")
    return [f"{RC}is_level={level}"]


def threshold(prefix: str, value: str) -> list[str]:
    """verl's threshold: a float (an upper bound) or "lower_upper" (a band)."""
    lower, sep, upper = bare(value).partition("_")
    return [f"{prefix}_lower={float(lower)}", f"{prefix}={float(upper)}"] if sep else [f"{prefix}={float(lower)}"]


def _rollout_rs(value: str) -> list[str]:
    rs = bare(value).lower()
    if is_null(rs):
        return []
    rs = _OLD_RS.get(rs, rs)
    if rs not in RS_CRITERIA:
        raise ValueError(f"rollout_rs={bare(value)} is not one of {', '.join((*_OLD_RS, *RS_CRITERIA))} "
                         f"(actor.rollout_correction.rs); one criterion at a time")
    return [f"{RC}rs={rs}"]


def _loss_type(value: str) -> list[str]:
    kind = bare(value).lower()
    if kind not in ("ppo_clip", "reinforce"):
        raise ValueError(f"rollout_correction.loss_type={bare(value)} is not ppo_clip or reinforce "
                         "(actor.policy_loss=dapo | reinforce)")
    return ["actor.policy_loss=reinforce"] if kind == "reinforce" else []


def _loss_mode(value: str) -> list[str]:
    mode = bare(value).lower()
    if mode not in _LOSS_MODES:
        raise ValueError(f"policy_loss.loss_mode={bare(value)} is not one of {', '.join(_LOSS_MODES)} "
                         f"(actor.policy_loss: {', '.join(POLICY_LOSSES)})")
    return _LOSS_MODES[mode]


# verl key -> its value mapped to our overrides (verl_compat.VALUE_RULES takes them in).
LOSS_RULES: dict[str, Callable[[str], list[str]]] = {
    "algorithm.rollout_correction.rollout_is": _rollout_is,
    # bypass mode: pi_old is the rollout's log-probs (two policies, no old-log-prob pass)
    "algorithm.rollout_correction.bypass_mode": lambda v: ["actor.old_logprobs=rollout"] if is_true(v) else [],
    # bypass mode's two losses (read in bypass mode only: `_cross_key`): the clipped ratio
    # pi / pi_rollout, or REINFORCE weighted by it. use_policy_gradient: verl 0.9.1's switch for it
    "algorithm.rollout_correction.loss_type": _loss_type,
    "algorithm.rollout_correction.use_policy_gradient": lambda v: _loss_type("reinforce" if is_true(v) else "ppo_clip"),
    "algorithm.rollout_correction.rollout_rs": _rollout_rs,
    "algorithm.rollout_correction.rollout_rs_threshold": lambda v: threshold(f"{RC}rs_threshold", v),
    "algorithm.rollout_correction.rollout_rs_threshold_lower": lambda v: [f"{RC}rs_threshold_lower={float(bare(v))}"],
    "algorithm.rollout_correction.rollout_token_veto_threshold": lambda v: (
        [] if is_null(v) else [f"{RC}veto_threshold={float(bare(v))}"]),
    "actor_rollout_ref.actor.policy_loss.loss_mode": _loss_mode,
}
