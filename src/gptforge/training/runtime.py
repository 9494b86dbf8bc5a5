"""Where and how a training stage runs: `Runtime` (the device, this process's rank among the
torchrun processes, the precision, torch.compile) and `setup_runtime`, which picks them from
`pretrain.device`, `pretrain.precision` and `pretrain.compile` and joins the process group.
Pretraining and every fine-tuning stage run on one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from gptforge.config.schema import Config
from gptforge.errors import BadInput


@dataclass
class Runtime:
    device: torch.device
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    ddp: bool = False
    precision: str = "fp32"  # fp32 | bf16 | fp16
    compile: bool = False

    @property
    def master(self) -> bool:
        return self.rank == 0

    def autocast(self):
        if self.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
        return torch.autocast(device_type=self.device.type, dtype=dtype)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def setup_runtime(cfg: Config) -> Runtime:
    from gptforge.training.processes import join

    p = cfg.pretrain
    if p.device == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device_type = p.device.split(":")[0]
        if device_type not in ("cpu", "cuda"):
            raise BadInput(f"pretrain.device: expected auto, cpu, cuda or cuda:N, got {p.device!r}")
        if device_type == "cuda" and not torch.cuda.is_available():
            raise BadInput("pretrain.device is cuda but no CUDA device is available")
    rank, local_rank, world = join(device_type)
    ddp = world > 1
    if device_type == "cuda":
        index = local_rank if ddp or ":" not in p.device else int(p.device.split(":")[1])
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        # TF32 matmuls: ~8x the fp32 tensor throughput on Ampere+, 10-bit mantissa inputs.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device("cpu")
    precision = p.precision if p.precision != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    compile_ = p.compile if p.compile != "auto" else device.type == "cuda"
    return Runtime(device, rank, local_rank, world, ddp, precision, bool(compile_))
