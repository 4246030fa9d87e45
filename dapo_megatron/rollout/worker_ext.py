"""Weight sync inside a vLLM worker: load HF-named buckets into the live model, and read the live
model back as HF-named tensors for checksums.

vLLM mixes `WeightSyncExtension` into its worker class (`worker_extension_cls`). An engine whose
single worker lives in the engine's process calls these methods directly with tensors; an engine
with several worker processes reaches them through `collective_rpc` with safetensors bytes.

How vLLM's fused parameters map back to HF names (tables below, code only for the splits):
- `self_attn.qkv_proj` = rows [q_proj; k_proj; v_proj] (weight and bias), split by the layer's
  `output_partition_sizes`; `mlp.gate_up_proj` = rows [gate_proj; up_proj].
- MoE `mlp.experts.routed_experts.w13_weight` [E, 2I, H] = per expert e rows
  [experts.e.gate_proj; experts.e.up_proj]; `w2_weight` [E, H, I] = experts.e.down_proj.
  A CPU kernel may pad I to P >= I: gate rows [0, I), up rows [P, P+I), down columns [0, I).
- `embed_tokens` / `lm_head` rows are padded to a multiple of 64: rows [0, vocab_size) are HF's.
- Every other parameter has the HF name and layout. Tied embeddings: vLLM holds no `lm_head`.
- A model that vLLM loads under other module prefixes says so in its own renaming table
  (`hf_to_vllm_mapper.orig_to_new_prefix`), read here inverted: Qwen3-VL's
  `model.language_model.` is vLLM's `language_model.model.`, `lm_head.` its `language_model.lm_head.`,
  the vision tower `model.visual.` its `visual.` (HF's layout; its `attn.qkv`, fused in HF too, is
  sharded q / k / v part by part over TP, so a worker holds several slices of it).
- TP > 1: each worker holds a slice of most tensors (column-parallel rows, row-parallel columns,
  vocab rows, expert intermediate rows/columns); `hf_named_shards` says where each slice sits, so
  checksums are taken per slice and merged by the engine (`checksum.shard_checksum`).
On CPU the live tensors are repacked for the kernels, so they are unpacked first: dense linears
keep their weight only inside a oneDNN / packed-GEMM handle (the parameter has size 0) and are read
by multiplying with an identity (exact: one nonzero product per output); MoE weights are
prepacked by a fixed permutation, found by prepacking index tensors and inverted.
"""
from __future__ import annotations

from typing import Iterable, Iterator, NamedTuple, Optional, Union

import torch

from dapo_megatron.device import get_device
from dapo_megatron.weights.checksum import Checksum, merge_checksums, shard_checksum

# vLLM fused module (last name component) -> the HF modules it stacks along dim 0.
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# vLLM expert parameter -> HF parameter names of one expert, stacked along dim 1 ([E, rows, cols]).
EXPERT_PARAMS = {"w13_weight": ("gate_proj.weight", "up_proj.weight"), "w2_weight": ("down_proj.weight",)}
# HF leaves of a fused QKV whose heads vLLM replicates when the TP size exceeds the KV head count.
KV_LEAVES = ("k_proj", "v_proj")
# vLLM module path components that HF checkpoints do not have.
VLLM_ONLY_MODULES = (".routed_experts",)

Bucket = Union[list[tuple[str, torch.Tensor]], bytes]


def hf_prefixes(model) -> dict[str, str]:
    """vLLM module prefix -> HF prefix: the model's load-time prefix renaming, inverted ({} for the
    text models, whose modules carry the HF names)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return {new: hf for hf, new in getattr(mapper, "orig_to_new_prefix", {}).items() if new is not None}


def hf_module_name(vllm_module: str, prefixes: Optional[dict[str, str]] = None) -> str:
    """The HF name of a vLLM module path (`prefixes`: `hf_prefixes` of its model)."""
    for part in VLLM_ONLY_MODULES:
        vllm_module = vllm_module.replace(part, "")
    dotted = vllm_module + "."
    for prefix in sorted(prefixes or {}, key=len, reverse=True):
        if dotted.startswith(prefix):
            return (prefixes[prefix] + dotted[len(prefix):])[:-1]
    return vllm_module


def _is_cpu_packed_moe(layer) -> bool:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    return isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch


@torch.no_grad()
def _unpack_linear(module, param: torch.Tensor) -> torch.Tensor:
    """[N, K] weight of a CPU linear whose parameter was replaced by a packed kernel handle."""
    k = getattr(module, "input_size_per_partition", None) or module.input_size
    cols = []
    for start in range(0, k, 4096):  # identity blocks bound the probe's memory
        eye = torch.eye(k, dtype=param.dtype)[start:start + 4096]
        cols.append(module.cpu_linear(eye, param, None).to(param.dtype))  # [k_blk, N] = W^T rows
    return torch.cat(cols).t().contiguous()


_PERMUTATIONS: dict[tuple, torch.Tensor] = {}


@torch.no_grad()
def _moe_permutation(shape: tuple, dtype: torch.dtype, isa: str) -> torch.Tensor:
    """perm with packed.flatten() == raw.flatten()[perm], found by prepacking index digits.

    Each digit tensor holds integers small enough to be exact in `dtype`, so the prepack (a pure
    reordering of elements) carries them unchanged.
    """
    key = (shape, dtype, isa)
    if key not in _PERMUTATIONS:
        from vllm._custom_ops import cpu_prepack_moe_weight
        base = {torch.float32: 1 << 22, torch.float16: 1 << 10}.get(dtype, 1 << 7)
        idx = torch.arange(int(torch.Size(shape).numel()), dtype=torch.int64)
        perm, scale, rest = torch.zeros_like(idx), 1, idx
        while True:
            digit = cpu_prepack_moe_weight((rest % base).to(dtype).reshape(shape), isa)
            perm += digit.reshape(-1).to(torch.int64) * scale
            rest, scale = rest // base, scale * base
            if scale >= idx.numel():
                break
        _PERMUTATIONS[key] = perm
    return _PERMUTATIONS[key]


def _unpack_moe(layer, param: torch.Tensor) -> torch.Tensor:
    perm = _moe_permutation(tuple(param.shape), param.dtype, layer.quant_method.moe_kernel.fused_experts.isa)
    raw = torch.empty(param.numel(), dtype=param.dtype)
    raw[perm] = param.detach().reshape(-1)
    return raw.reshape(param.shape)


class Slice(NamedTuple):
    """Where a worker's tensor sits in the HF tensor: full.narrow(dim, offset, tensor.shape[dim])."""
    full_shape: tuple[int, ...]
    dim: int
    offset: int


def _along(t: torch.Tensor, dim: int, rank: int, size: int) -> Slice:
    """The `rank`-th of `size` equal slices along `dim` (TP sharding)."""
    full = list(t.shape)
    full[dim] *= size
    return Slice(tuple(full), dim, rank * t.shape[dim])


def hf_named_shards(model) -> Iterator[tuple[str, torch.Tensor, Slice]]:
    """This worker's part of the live model as (hf_name, tensor in HF layout, its Slice of the HF
    tensor). A tensor replicated over the TP ranks comes from TP rank 0 only, a KV head replicated
    over several ranks from the first of them, so the workers' parts cover each tensor once."""
    from vllm.distributed import get_tensor_model_parallel_rank
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
    tp_rank = get_tensor_model_parallel_rank()
    modules, prefixes = dict(model.named_modules()), hf_prefixes(model)
    for name, param in model.named_parameters():
        module_name, _, pname = name.rpartition(".")
        module = modules[module_name]
        hf_module = hf_module_name(module_name, prefixes)
        tensor = param.detach()
        if pname == "weight" and tensor.numel() == 0 and hasattr(module, "cpu_linear"):
            tensor = _unpack_linear(module, tensor)
        if pname in EXPERT_PARAMS:
            tensor = _unpack_moe(module, tensor) if _is_cpu_packed_moe(module) else tensor
            yield from _split_experts(hf_module, pname, tensor, module.moe_config,
                                      global_expert_ids(_expert_map(module), tensor.shape[0]))
        elif module_name.rpartition(".")[2] in FUSED_MODULES:
            yield from _split_fused(module, hf_module, pname, tensor)
        elif len(getattr(module, "output_partition_sizes", ())) > 1 and module.tp_size > 1:
            yield from _fused_in_hf(module, f"{hf_module}.{pname}", tensor)
        elif isinstance(module, ColumnParallelLinear) and module.tp_size > 1:
            yield f"{hf_module}.{pname}", tensor, _along(tensor, 0, module.tp_rank, module.tp_size)
        elif isinstance(module, RowParallelLinear) and module.tp_size > 1 and pname == "weight":
            yield f"{hf_module}.{pname}", tensor, _along(tensor, 1, module.tp_rank, module.tp_size)
        elif hasattr(module, "org_vocab_size"):  # embed_tokens / lm_head: drop the padding rows
            rows = module.shard_indices
            part = tensor[:rows.org_vocab_end_index - rows.org_vocab_start_index]
            yield (f"{hf_module}.{pname}", part,
                   Slice((module.org_vocab_size, *part.shape[1:]), 0, rows.org_vocab_start_index))
        elif tp_rank == 0:  # replicated (norms, router, row-parallel biases): TP rank 0's copy
            yield f"{hf_module}.{pname}", tensor, Slice(tuple(tensor.shape), 0, 0)


def hf_named_tensors(model) -> Iterator[tuple[str, torch.Tensor]]:
    """The live model as (hf_name, tensor) in HF layout; whole tensors on a single-worker engine."""
    for name, tensor, _ in hf_named_shards(model):
        yield name, tensor


def _split_fused(module, hf_module: str, pname: str, t: torch.Tensor):
    """The HF tensors stacked in a fused linear's rows, each as this TP rank's slice."""
    parent, _, leaf = hf_module.rpartition(".")
    for hf_leaf, part in zip(FUSED_MODULES[leaf], torch.split(t, list(module.output_partition_sizes), dim=0)):
        replicas = getattr(module, "num_kv_head_replicas", 1) if hf_leaf in KV_LEAVES else 1
        if module.tp_rank % replicas == 0:  # ranks sharing one KV head: the first one counts it
            yield f"{parent}.{hf_leaf}.{pname}", part, _along(part, 0, module.tp_rank // replicas,
                                                            module.tp_size // replicas)


def _fused_in_hf(module, hf_name: str, t: torch.Tensor):
    """A linear that vLLM shards part by part but HF holds as one tensor (Qwen3-VL's vision
    `attn.qkv` = rows [q; k; v]): this rank's rows of each part, at their place in the HF tensor
    (several slices under one name; the worker's checksums add them up). Its KV heads are not
    replicated over TP (the vision tower has as many as query heads)."""
    sizes = list(module.output_partition_sizes)
    full, start = (t.shape[0] * module.tp_size, *t.shape[1:]), 0
    for size, part in zip(sizes, torch.split(t, sizes, dim=0)):
        yield hf_name, part, Slice(full, 0, start + module.tp_rank * size)
        start += size * module.tp_size


def _expert_map(module) -> Optional[torch.Tensor]:
    """vLLM's global -> local expert map of an expert-parallel MoE layer (None without EP)."""
    manager = getattr(module, "expert_map_manager", None)
    return manager.expert_map if manager is not None else getattr(module, "expert_map", None)


def global_expert_ids(expert_map: Optional[torch.Tensor], local_experts: int) -> list[int]:
    """The global id of each of this worker's local experts: vLLM's expert map (global id ->
    local id, -1 for experts on other EP ranks; linear or round-robin placement) inverted."""
    if expert_map is None:
        return list(range(local_experts))
    ids = [-1] * local_experts
    for global_id, local_id in enumerate(expert_map.tolist()):
        if local_id >= 0:
            ids[local_id] = global_id
    if -1 in ids:
        raise RuntimeError(f"vLLM's expert map places no global expert at local slot {ids.index(-1)}")
    return ids


def _split_experts(hf_module: str, pname: str, t: torch.Tensor, moe, global_ids: list[int]):
    """Per-expert HF tensors of a [E_local, rows, cols] expert weight, named by global expert id,
    the intermediate dim cut to the unpadded size and sliced over the MoE's TP ranks (1 under EP:
    an expert-parallel engine holds whole experts)."""
    inter, rank, size = moe.intermediate_size_per_partition, moe.tp_rank, moe.tp_size
    for local, e in enumerate(global_ids):
        if pname == "w13_weight":
            padded = t.shape[1] // 2
            for leaf, rows in (("gate_proj", t[local, :inter]), ("up_proj", t[local, padded:padded + inter])):
                yield f"{hf_module}.{e}.{leaf}.weight", rows, _along(rows, 0, rank, size)
        else:
            cols = t[local, :, :inter]
            yield f"{hf_module}.{e}.down_proj.weight", cols, _along(cols, 1, rank, size)


def _reprocess_tied(model) -> None:
    """Run the post-load step again on every module whose weight is another module's (a tied
    lm_head). vLLM's update path processes the modules that received tensors; a tied head receives
    none (it is the embedding), so on CPU it kept a packed copy of the old weights and every logit
    came from them, while the checksums, which read the embedding, agreed."""
    owners: dict[int, list] = {}
    for module in model.modules():
        weight = module._parameters.get("weight")
        if weight is not None and hasattr(getattr(module, "quant_method", None), "process_weights_after_loading"):
            owners.setdefault(id(weight), []).append(module)
    for module in (m for modules in owners.values() if len(modules) > 1 for m in modules):
        module.quant_method.process_weights_after_loading(module)


class WeightSyncExtension:
    """Mixed into vLLM's worker: a weight update is begin -> load (one call per bucket) -> finish;
    and `device_setup`, the device layer's per-worker set-up, called once the engine is built.

    Between begin and finish vLLM buffers each layer's tensors until the layer is complete, so a
    fused layer (q/k/v, gate/up, all experts of a layer) may span buckets; bucket tensors must
    stay unmodified until finish.
    """

    def device_setup(self) -> None:
        get_device().setup_vllm_worker(self.model_runner)

    def weight_sync_begin(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload
        initialize_layerwise_reload(self.model_runner.get_model())
        self._weight_sync_names: set[str] = set()

    def weight_sync_load(self, bucket: Bucket) -> int:
        if isinstance(bucket, (bytes, bytearray)):
            from safetensors.torch import load
            bucket = list(load(bytes(bucket)).items())
        self.model_runner.get_model().load_weights(iter(bucket))
        self._weight_sync_names.update(name for name, _ in bucket)
        return len(bucket)

    def weight_sync_finish(self) -> int:
        """Process the remaining layers. (On CPU the experts' repacking, which vLLM's update path
        skips, runs inside that processing: `device/vllm_cpu.py`.) The engine then resets the
        prefix and encoder caches (`Engine.finish_weight_update`)."""
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload
        model = self.model_runner.get_model()
        finalize_layerwise_reload(model, self.vllm_config.model_config)
        _reprocess_tied(model)
        loaded, self._weight_sync_names = len(self._weight_sync_names), set()
        return loaded

    def weight_sync_checksums(self) -> dict[str, Checksum]:
        """Partial checksums of this worker's slices; the engine merges its workers' partials."""
        return merge_checksums({name: shard_checksum(t, *where)}
                               for name, t, where in hf_named_shards(self.model_runner.get_model()))

    def weight_sync_hf_tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Copies of the named HF tensors as the engine holds them (debugging and tests)."""
        wanted = set(names)
        return {n: t.clone() for n, t in hf_named_tensors(self.model_runner.get_model()) if n in wanted}


def safetensors_bytes(bucket: list[tuple[str, torch.Tensor]]) -> bytes:
    """A bucket as safetensors bytes: what `weight_sync_load` reads from a worker in another process."""
    from safetensors.torch import save
    return save({name: t.detach().contiguous().cpu() for name, t in bucket})
