"""The engine as a Ray actor: the same `Engine` class, placed by the driver.

The actor process owns the vLLM engine in-process, so buckets sent to `load_weights` arrive as
tensors from Ray's object store and go into the model without another copy. Ray calls run on
several threads (`max_concurrency`) so that a `poll` waiting for results does not block `submit`,
`abort` or a weight push; `Engine` serialises them onto its loop thread.
"""
from __future__ import annotations

from typing import Optional

from dapo_megatron.device import get_device
from dapo_megatron.logs import redirect_output
from dapo_megatron.rollout.engine import Engine

# Concurrent actor calls: poll + submit + abort + weight pushes, and with the broadcast sync
# transport one blocking `receive_weights` per sending trainer rank (EP ranks x PP stages).
MAX_CONCURRENCY = 64


class EngineActor(Engine):
    """`Engine` in its own process, its library output sent to `log_path` before vLLM starts."""

    def __init__(self, *args, log_path: Optional[str] = None, **kwargs):
        redirect_output(log_path)
        super().__init__(*args, **kwargs)


def engine_actor(model_path: str, cfg, *, dtype: str = "bf16", max_model_len: int = 4096,
                 device: str = "auto", name: Optional[str] = None, log_path: Optional[str] = None,
                 return_routes: bool = False, tokenizer_path: Optional[str] = None, **ray_options):
    """Start one engine actor; returns its handle (methods as on `Engine`, called with .remote()).

    ray_options: the actor's resources and placement (`Device.ray_options`, a scheduling
    strategy). log_path: where the engine's library output goes (None: the console). The device
    layer's vLLM environment goes into the actor's runtime env, so it is set before vLLM is imported.
    """
    import ray
    env = get_device(device).vllm_env(cfg.parallel.tp)
    options = dict(ray_options, max_concurrency=MAX_CONCURRENCY, runtime_env={"env_vars": env})
    if name is not None:
        options["name"] = name
    return ray.remote(EngineActor).options(**options).remote(
        model_path, cfg, dtype=dtype, max_model_len=max_model_len, device=device, log_path=log_path,
        return_routes=return_routes, tokenizer_path=tokenizer_path)
