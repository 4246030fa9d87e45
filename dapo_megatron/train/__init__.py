"""Training side: parallel init (the only parallel_state user), actor, reference, checkpoints."""
