"""Model FLOPs utilisation (MFU): achieved model FLOP/s over the device's dense peak.

The FLOP count is the PaLM paper's (appendix B), as nanoGPT's `estimate_mfu` uses it:
6N per token for the matmuls with the N weights (forward 2N, backward 4N) plus 12·L·H·Q·T for
the attention scores and their weighted sum over a context of T. Rematerialisation is not
counted: this is model FLOPs, not hardware FLOPs.

Peaks are the vendors' DENSE figures (the datasheets' headline tensor-core numbers assume 2:4
structured sparsity; they are halved here). Half precision means bf16/fp16 tensor-core math with
fp32 accumulate, which is what PyTorch's matmuls use.
"""

from __future__ import annotations

import logging
import re

import torch

from gptforge.errors import BadInput

log = logging.getLogger(__name__)

T = 1e12

# Dense peak FLOP/s by precision, keyed by a case-insensitive substring of
# torch.cuda.get_device_name() that must not touch a letter or digit on either side ("A10" is
# not found in "A100" nor in "A10G", "A100" not in "RTX A1000", "L4" not in "L40S"); the
# longest matching key wins ("H100 PCIe" over "H100"). "half" is bf16/fp16 tensor cores with
# fp32 accumulate, "tf32" tensor-core TF32, "fp32" the non-tensor CUDA cores. No "half"/"tf32"
# entry: the device has no such tensor-core path (V100 and T4 have no bf16: "bf16" then has
# no peak and MFU is not reported).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    # NVIDIA H100 Tensor Core GPU whitepaper / datasheet, H100 SXM5: BF16 1978.9 sparse
    # -> 989.4 dense, TF32 989.4 -> 494.7 dense, FP32 66.9. Device name "NVIDIA H100 80GB HBM3".
    "H100": {"half": 989.4 * T, "tf32": 494.7 * T, "fp32": 66.9 * T},
    # Same sources, H100 PCIe: BF16 1513 sparse -> 756 dense, TF32 756 -> 378, FP32 51.2.
    "H100 PCIe": {"half": 756 * T, "tf32": 378 * T, "fp32": 51.2 * T},
    # H100 NVL datasheet: BF16 1671 sparse -> 835.5 dense, TF32 835 -> 417.5, FP32 60.
    "H100 NVL": {"half": 835.5 * T, "tf32": 417.5 * T, "fp32": 60 * T},
    # H200 datasheet (SXM): same tensor cores and clocks as H100 SXM: BF16 1979 sparse -> 989.5,
    # TF32 989 -> 494.5, FP32 67.
    "H200": {"half": 989.5 * T, "tf32": 494.5 * T, "fp32": 67 * T},
    # H200 NVL datasheet: BF16 1671 sparse -> 835.5, TF32 835 -> 417.5, FP32 60.
    "H200 NVL": {"half": 835.5 * T, "tf32": 417.5 * T, "fp32": 60 * T},
    # GH200 Grace Hopper datasheet (its H100 GPU): BF16 1979 sparse -> 989.5, TF32 494.5, FP32 67.
    "GH200": {"half": 989.5 * T, "tf32": 494.5 * T, "fp32": 67 * T},
    # NVIDIA A100 datasheet (40/80 GB, SXM and PCIe alike): BF16 312 dense (624 sparse),
    # TF32 156 dense (312 sparse), FP32 19.5.
    "A100": {"half": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T},
    # NVIDIA A10 datasheet: BF16 125 dense (250 sparse), TF32 62.5 dense (125 sparse), FP32 31.2.
    "A10": {"half": 125 * T, "tf32": 62.5 * T, "fp32": 31.2 * T},
    # A10G (AWS G5 only, no public NVIDIA datasheet): figures AWS/NVIDIA give for it: BF16/FP16
    # tensor 70 dense, TF32 35, FP32 35 (fewer tensor-core FLOPs per clock than the A10).
    "A10G": {"half": 70 * T, "tf32": 35 * T, "fp32": 35 * T},
    # NVIDIA L4 datasheet: BF16 242 sparse -> 121 dense, TF32 120 sparse -> 60 dense, FP32 30.3.
    "L4": {"half": 121 * T, "tf32": 60 * T, "fp32": 30.3 * T},
    # NVIDIA L40S datasheet: BF16 733 sparse -> 366 dense, TF32 366 -> 183, FP32 91.6.
    "L40S": {"half": 366 * T, "tf32": 183 * T, "fp32": 91.6 * T},
    # NVIDIA Ada GPU architecture whitepaper, RTX 4090: FP16/BF16 tensor with FP32 accumulate
    # 165.2 dense (330.4 sparse; GeForce runs FP32 accumulate at half rate), TF32 82.6, FP32 82.6.
    "RTX 4090": {"half": 165.2 * T, "tf32": 82.6 * T, "fp32": 82.6 * T},
    # NVIDIA Ampere GA102 whitepaper, RTX 3090: FP16/BF16 tensor with FP32 accumulate 71 dense,
    # TF32 35.6, FP32 35.6.
    "RTX 3090": {"half": 71 * T, "tf32": 35.6 * T, "fp32": 35.6 * T},
    # NVIDIA V100 datasheet, SXM2: tensor (fp16 only) 125, FP32 15.7; PCIe: 112 and 14;
    # V100S PCIe: 130 and 16.4. No bf16, no tf32.
    "V100": {"fp16": 125 * T, "fp32": 15.7 * T},
    "V100-PCIE": {"fp16": 112 * T, "fp32": 14 * T},
    "V100S": {"fp16": 130 * T, "fp32": 16.4 * T},
    # NVIDIA T4 datasheet: mixed-precision (FP16/FP32) tensor 65, FP32 8.1. No bf16, no tf32.
    "T4": {"fp16": 65 * T, "fp32": 8.1 * T},
}

_PRECISIONS = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "tf32": "tf32",
}


def lookup_peak(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """The table's dense peak for a CUDA device name and a precision, or None if not listed.

    precision: "bf16"/"fp16" (tensor-core half) or "fp32" (tensor-core TF32 when `tf32`, as
    fp32 matmuls run with TF32 allowed; else the CUDA cores) or "tf32".
    """
    kind = _precision_kind(precision)
    if kind == "fp32" and tf32:
        kind = "tf32"
    name = device_name.lower()
    matches = [k for k in PEAK_FLOPS if re.search(rf"(?<![a-z0-9]){re.escape(k.lower())}(?![a-z0-9])", name)]
    if not matches:
        return None
    entry = PEAK_FLOPS[max(matches, key=len)]
    if kind == "bf16":
        return entry.get("half")
    if kind == "fp16":
        return entry.get("half", entry.get("fp16"))
    if kind == "tf32":
        return entry.get("tf32", entry["fp32"])  # no TF32 tensor cores: fp32 matmuls stay on CUDA cores
    return entry["fp32"]


def _precision_kind(precision: str) -> str:
    kind = _PRECISIONS.get(str(precision).lower())
    if kind is None:
        raise BadInput(f"unknown precision {precision!r} for the peak FLOP/s table (bf16, fp16 or fp32)")
    return kind


def _tf32_enabled() -> bool:
    return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"


def peak_flops(device: torch.device | str, precision: str, override: float | None = None) -> float | None:
    """Peak FLOP/s of ONE device for MFU; None when unknown (then MFU is not reported).

    `override` (pretrain.peak_flops) wins. CUDA: looked up by device name in PEAK_FLOPS, fp32
    counting as TF32 when TF32 matmuls are on. CPU and other devices: None, since a CPU's
    peak depends on cores, clocks and vector units that torch does not report.
    """
    if override is not None:
        if not override > 0:
            raise BadInput(f"pretrain.peak_flops must be > 0 FLOP/s, got {override}")
        return float(override)
    kind = _precision_kind(precision)
    device = torch.device(device)
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = lookup_peak(name, kind, tf32=kind == "fp32" and _tf32_enabled())
    if peak is None:
        log.warning(
            "no peak FLOP/s known for %s at %s; MFU is not reported. Set pretrain.peak_flops "
            "(dense FLOP/s of one device) to report it",
            name,
            kind,
        )
    return peak


def flops_per_token(n_params_non_embedding: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward): 6N + 12·L·H·Q·T (PaLM, appendix B).

    N is the number of weights that take part in a matmul for each token. nanoGPT passes all
    parameters but the position embeddings, so that a tied token embedding counts as the
    output layer (2·V·d FLOPs per token forward); pass N that way to count the lm_head.
    """
    n, l, h, q, t = n_params_non_embedding, n_layer, n_head, head_dim, seq_len
    return float(6 * n + 12 * l * h * q * t)


def mfu(tokens_per_sec: float, flops_per_token: float, peak: float | None) -> float | None:
    """Achieved model FLOP/s over `peak`; None when the peak is unknown.

    `tokens_per_sec` and `peak` must describe the same devices: one device's throughput and
    its peak, or the whole job's throughput and peak × world size.
    """
    if peak is None or peak <= 0:
        return None
    return tokens_per_sec * flops_per_token / peak
