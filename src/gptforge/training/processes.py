"""Which of torchrun's processes this is: joining the process group every training stage shares.

torchrun sets WORLD_SIZE, RANK and LOCAL_RANK in each worker. `join(device_type)` reads them and,
above one process, initializes the default process group (nccl on CUDA, gloo on the CPU) once;
pretraining (`training.runtime.setup_runtime`) and the fine-tuning stages
(`finetune.common.runtime`) both come through here.
"""

from __future__ import annotations

import os


def join(device_type: str) -> tuple[int, int, int]:
    """(rank, local rank, world size) of this process; (0, 0, 1) outside torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), world
