"""The parallel layout, as every floor may read it: this rank's coordinates and process groups.

`train/parallel.py` sets the layout up (torch.distributed, then Megatron's one
`initialize_model_parallel` call) and tears it down; the model builder, the weight maps, export,
sync and the checkpoint tools read it here, through `coords()` and `group()`, never through
Megatron's parallel_state. Megatron is imported inside the functions, so that importing this
module stays light (the driver, the convert CLI) and Megatron loads when a rank first reads the
layout, after `Device.setup_megatron` has prepared it.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class Coords:
    """This rank's place in the parallel layout: the size and this rank's index of each dimension."""
    rank: int
    world_size: int
    tp: int
    tp_rank: int
    pp: int
    pp_rank: int
    vpp: int  # virtual stages per pipeline rank (1: no interleaving)
    ep: int
    ep_rank: int
    etp: int
    etp_rank: int
    edp_rank: int  # replica index among ranks holding the same experts
    dp: int
    dp_rank: int
    cp: int
    cp_rank: int
    pp_last_rank: int  # global rank of the last stage of this rank's pipeline

    def is_first_stage(self, vp_stage: int | None = None) -> bool:
        return self.pp_rank == 0 and (vp_stage or 0) == 0

    def is_last_stage(self, vp_stage: int | None = None) -> bool:
        """The last pipeline stage; with `vp_stage`, its last virtual stage too."""
        return self.pp_rank == self.pp - 1 and (vp_stage is None or vp_stage == self.vpp - 1)


def coords() -> Coords:
    """The current layout, from Megatron's parallel state (after `train.parallel.init_parallel`)."""
    from megatron.core import parallel_state as mpu
    return Coords(
        rank=dist.get_rank(), world_size=dist.get_world_size(),
        tp=mpu.get_tensor_model_parallel_world_size(), tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp=mpu.get_pipeline_model_parallel_world_size(), pp_rank=mpu.get_pipeline_model_parallel_rank(),
        vpp=mpu.get_virtual_pipeline_model_parallel_world_size() or 1,
        ep=mpu.get_expert_model_parallel_world_size(), ep_rank=mpu.get_expert_model_parallel_rank(),
        etp=mpu.get_expert_tensor_parallel_world_size(), etp_rank=mpu.get_expert_tensor_parallel_rank(),
        edp_rank=mpu.get_expert_data_parallel_rank(),
        dp=mpu.get_data_parallel_world_size(), dp_rank=mpu.get_data_parallel_rank(),
        cp=mpu.get_context_parallel_world_size(), cp_rank=mpu.get_context_parallel_rank(),
        pp_last_rank=mpu.get_pipeline_model_parallel_last_rank())


_GROUPS = {  # name -> Megatron's getter of this rank's process group
    "tp": "get_tensor_model_parallel_group", "pp": "get_pipeline_model_parallel_group",
    "dp": "get_data_parallel_group", "ep": "get_expert_model_parallel_group",
    "etp": "get_expert_tensor_parallel_group",
}


def group(name: str):
    """This rank's process group of one dimension: tp, pp, dp, ep or etp."""
    from megatron.core import parallel_state as mpu
    return getattr(mpu, _GROUPS[name])()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now on `host` ("" for every interface: a rendezvous other nodes reach)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
