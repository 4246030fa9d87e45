"""DAPO math reward: math-verify scoring run safely, batch shaping, an optional HTTP service.

    math_score.py  score(response, ground_truth) -> RewardResult: extraction, safety caps, math-verify
    geo3k.py       geo3k's score: 0.9 x the math verdict on the last \\boxed{} + 0.1 x format
    scorers.py     data_source -> Scorer (geo3k, else math): the table the pool and client read
    pool.py        RewardPool: worker processes with a hard per-answer deadline (kill + restart)
    manager.py     RewardManager: config -> backend, overlong shaping, metrics (what the trainer calls)
    serve.py       python -m dapo_megatron.reward.serve; client.py: RewardClient
    _forkserver_preload.py   warms math-verify up once in the forkserver the workers fork from

Nothing is imported here: a worker process imports only math_score and pool (not torch), which
keeps restarts cheap. Import from the submodules.
"""
