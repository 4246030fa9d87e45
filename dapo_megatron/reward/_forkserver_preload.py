"""Imported once by the forkserver (`pool._PRELOAD`): math-verify's LaTeX grammar and sympy's
caches get loaded there, so every worker forked from it, restarts included, starts warm.
Its "timeout is disabled" warning is silenced: the pool's deadline is the timeout."""
import logging

from dapo_megatron.reward.math_score import warm_up

logging.getLogger("math_verify").setLevel(logging.ERROR)
warm_up()
