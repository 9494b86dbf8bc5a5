"""What both kernels need from their surroundings: where they can run, and output allocation.

A `@triton.jit` function is compiled for the GPU unless `TRITON_INTERPRET=1` was set when it was
*decorated* (that is, when its module was imported); then it is an `InterpretedFunction` that
runs on the CPU through NumPy, which is how the tests check the kernels without a GPU.
"""

from __future__ import annotations

import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


class KernelUnavailable(RuntimeError):
    """A kernel was asked to run where it cannot (CPU tensors without the Triton interpreter)."""


def is_interpreted(kernel) -> bool:
    """Whether `kernel` runs through the interpreter. Triton's own library functions (`tl.zeros`,
    ...) are decorated when triton is first imported: if TRITON_INTERPRET=1 came after that, our
    kernels are interpreted but the library is not, and nothing runs."""
    return isinstance(kernel, InterpretedFunction) and isinstance(tl.zeros, InterpretedFunction)


def check_runnable(kernel, name: str, *tensors: torch.Tensor) -> None:
    """Fail early with a sentence instead of Triton's pointer errors deep inside a launch."""
    if is_interpreted(kernel):
        return
    if isinstance(kernel, InterpretedFunction):
        raise KernelUnavailable(
            f"{name}: TRITON_INTERPRET=1 was set after triton was imported; set it before "
            f"the first `import triton` of the process"
        )
    devices = sorted({t.device.type for t in tensors})
    if devices != ["cuda"]:
        raise KernelUnavailable(
            f"{name} is a Triton GPU kernel and got {'/'.join(devices)} tensors: run it on CUDA, or set "
            f"TRITON_INTERPRET=1 before `kernels` is imported to run it (slowly) on the CPU through "
            f"Triton's interpreter"
        )


def empty(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    """Every kernel output is allocated here, uninitialised. The tests replace this function with
    one that fills the buffer with NaN, so an element a kernel forgets to write shows up."""
    return torch.empty(shape, dtype=dtype, device=device)
