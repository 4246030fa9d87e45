"""verl's fully asynchronous recipe (`verl.experimental.fully_async_policy`) in our keys.

Its keys describe one push period, not one optimizer step: the trainer takes `require_batches x
ppo_mini_batch_size` prompts per optimizer step and pushes weights after
`trigger_parameter_sync_step` of them; `staleness_threshold` bounds the share of a period's
samples started under older weights; `trainer.*` counts the trainer's devices and `rollout.*` the
rollouter's. Here a step is that push period: data.train_batch_size = trigger x require x mini
prompts, each mini-batch of require x mini one optimizer step as soon as its groups are in
(trainer.stream_minibatches), the push after the last one. The
keys read one another, so `plan` resolves them together; verl_compat.resolve asks it for each key.
"""
from __future__ import annotations

import math
from typing import Callable

from dapo_megatron.config.verl_losses import is_true

# verl's defaults (fully_async_ppo_trainer.yaml, actor.yaml) for a key a script leaves out
_DEFAULTS = {
    "async_training.staleness_threshold": "0.1", "async_training.trigger_parameter_sync_step": "4",
    "async_training.require_batches": "1", "async_training.partial_rollout": "true",
    "async_training.use_rollout_log_probs": "true", "async_training.compute_prox_log_prob": "false",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "256",
    "trainer.nnodes": "1", "trainer.n_gpus_per_node": "8", "rollout.nnodes": "1", "rollout.n_gpus_per_node": "8",
}
# Keys whose presence says the script is a fully asynchronous one (their namespace is verl's alone).
_MARKERS = ("rollout.nnodes", "rollout.n_gpus_per_node", "rollout.total_rollout_steps", "rollout.test_freq",
            "rollout.total_epochs")
_BATCH = ("async_training.trigger_parameter_sync_step", "async_training.require_batches",
          "actor_rollout_ref.actor.ppo_mini_batch_size")
_RESOURCES = ("trainer.nnodes", "trainer.n_gpus_per_node", "rollout.nnodes", "rollout.n_gpus_per_node")
_LOGPROBS = ("async_training.use_rollout_log_probs", "async_training.compute_prox_log_prob",
             "actor_rollout_ref.actor.use_rollout_log_probs")
_CKPT_ENGINE = "async_training.checkpoint_engine."


def is_fully_async(keys) -> bool:
    return any(k.startswith("async_training.") or k in _MARKERS for k in keys)


class Plan:
    """What each key of a fully asynchronous script becomes, from the values of all of them
    (`values`: key -> bare value, as the script gives them)."""

    def __init__(self, values: dict[str, str]):
        self.values = values

    def _get(self, key: str) -> str:
        return self.values.get(key, _DEFAULTS.get(key, ""))

    def _int(self, key: str, low: int = 1) -> int:
        text = self._get(key)
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not value == int(value) or value < low:  # nan fails too
            raise ValueError(f"{key}={text} is not a whole number >= {low}")
        return int(value)

    def _true(self, key: str) -> bool:
        return is_true(self._get(key))

    # ---- the push period as a step ---------------------------------------------------------------
    def batch(self) -> int:
        """Prompts a push period trains: our data.train_batch_size."""
        return self._int(_BATCH[0]) * self.mini_batch()

    def mini_batch(self) -> int:
        return self._int(_BATCH[1]) * self._int(_BATCH[2])

    def _batch_overrides(self) -> list[str]:
        b = self.batch()
        # a generation round is one batch of prompts: the early stop streams them as capacity frees;
        # verl's trainer starts each optimizer step once its require_batches are in: streamed here
        return [f"data.train_batch_size={b}", f"data.gen_batch_size={b}", f"actor.ppo_mini_batch_size={self.mini_batch()}",
                "trainer.stream_minibatches=true"]

    def _mode(self) -> list[str]:
        """staleness_threshold: 0 is on-policy (the engines wait for each push), a share below 1
        bounds the groups carried across a push (partial rollouts), 1 or more lags whole steps."""
        text = self._get("async_training.staleness_threshold")
        try:
            share = float(text)
        except ValueError:
            share = -1.0
        if not share >= 0:
            raise ValueError(f"async_training.staleness_threshold={text} is not a share >= 0")
        split = ["trainer.placement=split", "algorithm.filter_groups.mode=early_stop"]
        if share == 0:
            return ["trainer.mode=sync", *split]
        if share >= 1:
            return ["trainer.mode=async", *split, f"trainer.max_staleness={math.ceil(share)}"]
        if not self._true("async_training.partial_rollout"):
            raise ValueError(f"async_training.staleness_threshold={text} with partial_rollout=False: the share "
                             "bound here acts on groups carried across a push (trainer.stale_share needs "
                             "trainer.partial_rollout=true); set partial_rollout=True, or a threshold of 0 or >= 1")
        return ["trainer.mode=async", *split, "trainer.max_staleness=1", f"trainer.stale_share={share}"]

    def _resources(self) -> list[str]:
        """verl's two pools -> our devices: the engines take the last rollout.num_devices of them."""
        tn, tg, rn, rg = (self._int(k) for k in _RESOURCES)
        if tg == rg:  # pools on nodes of their own
            nodes, per_node = tn + rn, tg
        elif tn == rn:  # each node split between the pools (verl's 4_12 layout)
            nodes, per_node = tn, tg + rg
        else:
            raise ValueError(f"trainer {tn} x {tg} and rollout {rn} x {rg} devices: here every node has "
                             "trainer.n_gpus_per_node devices; give both pools the same devices per node, or "
                             "the same nodes")
        return [f"trainer.nnodes={nodes}", f"trainer.n_gpus_per_node={per_node}", f"rollout.num_devices={rn * rg}"]

    def _logprobs(self) -> list[str]:
        # the engine's log-probs as pi_old (verl's default here) is our bypass mode; the proximal
        # recompute is our old-log-prob pass, with the decoupled correction on by default
        # the actor's key defaults to async_training's (verl's ${oc.select:...})
        rollout = self._true(_LOGPROBS[2] if _LOGPROBS[2] in self.values else _LOGPROBS[0])
        bypass = rollout and not self._true(_LOGPROBS[1])
        return [f"actor.old_logprobs={'rollout' if bypass else 'auto'}"]

    def _total_steps(self) -> list[str]:
        # verl: total_train_steps = int(total_rollout_steps / (require x mini x trigger))
        return [f"trainer.total_training_steps={max(self._int('rollout.total_rollout_steps') // self.batch(), 1)}"]

    def _first(self, keys) -> str | None:
        """The first of `keys` the script gives: the one a setting they make together is shown under."""
        return next((k for k in self.values if k in keys), None)

    def outcome(self, key: str) -> tuple[str, tuple[str, ...], str]:
        """(action, our overrides, reason) of one key; raises ValueError to refuse it. Keys that make
        one setting together (a group) show it under the first of them the script gives."""
        group = next((g for g in _GROUPS if key in g), (key,))
        first = self._first(group)
        rule = _RULES.get(key) or _RULES[_CKPT_ENGINE]
        action, overrides, reason = rule(self)
        if key != first:
            overrides, reason = [], f"{reason}; set with {first}"
        # the mode has a default (verl's threshold): shown under a key of the script's when it gives none
        mode_key = next((k for k in ("async_training.staleness_threshold", "async_training.partial_rollout")
                         if k in self.values), next(k for k in self.values if is_fully_async([k])))
        if key == mode_key and key != "async_training.staleness_threshold":
            overrides = [*self._mode(), *overrides]
            reason = f"{reason}; with async_training.staleness_threshold={self._get('async_training.staleness_threshold')} (verl's default)"
            action = "translated"
        return action, tuple(overrides), reason.strip("; ")

    def handles(self, key: str) -> bool:
        return key in _RULES or key.startswith(_CKPT_ENGINE)


def _partial(plan: Plan) -> tuple[str, list[str], str]:
    on = plan._true("async_training.partial_rollout")
    if plan._mode()[0] == "trainer.mode=sync":
        return "ignored", [], "partial rollouts take effect only with staleness_threshold > 0 (in verl too)"
    return "translated", [f"trainer.partial_rollout={str(on).lower()}"], ""


def _ignored(why: str) -> Callable[[Plan], tuple[str, list[str], str]]:
    return lambda plan: ("ignored", [], why)


def _translated(fn: Callable[[Plan], list[str]], why: str = "") -> Callable[[Plan], tuple[str, list[str], str]]:
    return lambda plan: ("translated", fn(plan), why)


_GROUPS = (_BATCH, _RESOURCES, _LOGPROBS)
_PERIOD = ("one step here is a push period: trigger_parameter_sync_step mini-batches of require_batches x "
           "ppo_mini_batch_size prompts, one optimizer step each, the push after the last")
_RULES: dict[str, Callable[[Plan], tuple[str, list[str], str]]] = {
    "async_training.staleness_threshold": _translated(Plan._mode, "the share of a batch's groups started before "
                                                                  "the last push (trainer.stale_share)"),
    "async_training.partial_rollout": _partial,
    **{k: _translated(Plan._batch_overrides, _PERIOD) for k in _BATCH},
    **{k: _translated(Plan._resources, "verl's trainer and rollouter pools, together") for k in _RESOURCES},
    **{k: _translated(Plan._logprobs, "the engine's log-probs as pi_old is actor.old_logprobs=rollout; "
                                      "compute_prox_log_prob is the old-log-prob pass with the decoupled correction")
       for k in _LOGPROBS},
    "rollout.total_rollout_steps": _translated(Plan._total_steps, "prompts over the run / prompts a push period"),
    "rollout.total_epochs": _translated(lambda p: [f"trainer.total_epochs={p._int('rollout.total_epochs')}"]),
    "rollout.test_freq": _translated(lambda p: [f"trainer.test_freq={p._int('rollout.test_freq', low=-1)}"],
                                     "validation every that many pushes (steps), on the engines"),
    "data.train_batch_size": _ignored("not read by verl's fully asynchronous trainer either: " + _PERIOD),
    "data.gen_batch_size": _ignored("prompts stream to the engines one at a time as capacity frees (early stop), "
                                    "as verl's gen_batch_size=1 asks"),
    "async_training.use_trainer_do_validate": _ignored("validation runs on the engines between steps "
                                                       "(trainer.test_freq)"),
    "async_training.checkpoint_engine.device_buffer_size_M": _translated(
        lambda p: [f"rollout.sync.bucket_mb={p._int('async_training.checkpoint_engine.device_buffer_size_M')}"],
        "the weight sync's bucket"),
    _CKPT_ENGINE: _ignored("the weight sync is ours (rollout.sync: buckets over rollout.sync.transport); "
                           "its bucket is rollout.sync.bucket_mb"),
}
