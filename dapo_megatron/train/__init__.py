"""Training side: parallel init (the only one that sets up parallel_state), actor, reference, checkpoints."""
