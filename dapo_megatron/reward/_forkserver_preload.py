"""Imported once by the forkserver (`pool._PRELOAD`): math-verify's LaTeX grammar and sympy's
caches get loaded there, so every worker forked from it, restarts included, starts warm."""
from dapo_megatron import heap

with heap.start_up():  # the workers inherit the warm caches frozen: their collections skip them
    from dapo_megatron.reward.math_score import warm_up

    warm_up()
