"""Weight-only int8 and int4 linear layers for batch-1 decoding on the CPU, shared by both lean
decoders (`llama_decoding.LlamaLayers` of Llama-family models, `decoding.Decoder` of gptforge's
GPT): `Int8Weight` (one scale per output row, torch's `_weight_int8pack_mm`), `Int4Weight`
(16 levels per group of 32 inputs, torch's CPU int4 kernel), the functional `int8_linear` /
`int4_linear` that take them in F.linear's place, `PACKED` by format name, `pack_all` (the
packed copies of a model's weights, kept on the model until they change), `packing` (what a
decoder multiplies by under a format), and `round_linears`,
which rounds a model's own weights in place so that its module forward (a prefill) computes what
the packed step computes. At batch 1 each token reads every weight once, so fewer bytes are a
faster token; the accuracy each costs is measured in docs/hf-models.md.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from gptforge.errors import BadInput


class Int8Weight:
    """A linear layer's weight (out, in) as int8 with one scale per output row (symmetric,
    round to nearest: w ~= q * scale), in the activations' dtype, as
    `torch._weight_int8pack_mm` takes it: a quarter of float32's bytes, half of bf16's."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype):
        w = weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        self.q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(dtype)

    def dequantized(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]

    @staticmethod
    def rounded(weight: torch.Tensor) -> torch.Tensor:
        """The weight the kernel multiplies by, in float32."""
        return Int8Weight(weight, weight.dtype).dequantized()


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear with an `Int8Weight`: x (..., in) in the scales' dtype."""
    y = torch._weight_int8pack_mm(x.reshape(-1, x.size(-1)), w.q, w.scale).view(*x.shape[:-1], w.q.size(0))
    return y if bias is None else y + bias


# int4: 16 levels per group of 32 input columns, each group its own scale and offset (the
# asymmetric min/max rounding of gpt-fast and llama.cpp's Q4_1, whose blocks are 32 too).
INT4_GROUP = 32


def int4_groups(weight: torch.Tensor, group: int = INT4_GROUP):
    """The int4 rounding of `weight` (out, in): integers 0..15 (int32, (out, in)) and each
    group's scale and zero (float32, (out, in / group)), such that w ~= (q - 8) * scale + zero:
    a group's smallest value maps to 0, its largest to 15."""
    n, k = weight.shape
    if k % group:
        raise BadInput(f"int4 weights need an input width divisible by {group}, got {k}")
    w = weight.detach().float().view(n, k // group, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale = (high - low).clamp(min=1e-6) / 15
    q = torch.round((w - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    return q, scale, low + 8 * scale


class Int4Weight:
    """A linear layer's weight (out, in) rounded by `int4_groups`, packed as
    `torch._weight_int4pack_mm_for_cpu` takes it: an eighth of float32's bytes, a quarter of
    bf16's (plus two scalars per group of 32). `in` must be a multiple of the group (every
    Llama-family width is); `out` is padded with zero rows to the kernel's multiple of 16 (a
    vocabulary of 50257), and `int4_linear` returns the first `out` columns."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, group: int = INT4_GROUP):
        if weight.device.type != "cpu":
            raise BadInput(f"int4 weights run on the CPU (torch's CPU int4 kernel), not {weight.device.type}: use int8")
        q, scale, zero = int4_groups(weight, group)
        self.group, self.out = group, q.size(0)
        pad = -self.out % 16
        if pad:  # zero rows: q 8, scale and zero 0 -> weights 0
            q = torch.cat([q, torch.full((pad, q.size(1)), 8, dtype=q.dtype)])
            scale, zero = (torch.cat([t, torch.zeros(pad, t.size(1))]) for t in (scale, zero))
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        # the kernel's layout: (groups, out, [scale, zero]) in the activations' dtype
        self.scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)

    @staticmethod
    def rounded(weight: torch.Tensor, group: int = INT4_GROUP) -> torch.Tensor:
        """The weight the kernel multiplies by, in float32: (q - 8) * scale + zero, with scale
        and zero in the weight's dtype (the activations' dtype, as the kernel holds them)."""
        q, scale, zero = int4_groups(weight, group)
        scale, zero = (t.to(weight.dtype).float()[..., None] for t in (scale, zero))
        n, k = q.shape
        return ((q.view(n, k // group, group).float() - 8) * scale + zero).view(n, k)


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear with an `Int4Weight`: x (..., in) in the scales' dtype."""
    y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, x.size(-1)), w.packed, w.group, w.scales_zeros)
    y = y[:, : w.out].reshape(*x.shape[:-1], w.out)
    return y if bias is None else y + bias


WEIGHT_FORMATS = ("native", "int8", "int4")
PACKED = {"int8": (Int8Weight, int8_linear), "int4": (Int4Weight, int4_linear)}
# The head's format under int8 and int4 alike, as llama.cpp keeps a Q4 file's output tensor in
# more bits: an int4 head raised SmolLM2's perplexity on FineWeb-Edu 6.5% (int4 layers, int8
# head: 0.6%), for 1.5 ms a token saved (benchmarks/quantized_accuracy.py, docs/hf-models.md).
HEAD_WEIGHTS = "int8"


def pack_all(owner: nn.Module, weights: list[torch.Tensor], fmt: str, dtype: torch.dtype, role: str = "layers"):
    """The `PACKED[fmt]` packing of each of `weights`, in their order, kept on `owner` (the model)
    until one of them changes (another tensor, or an in-place update: its version counter), as
    `GreedyHead` keeps its screen: a second `generate` on the same model does not pack again
    (SmolLM2's 210 linears: 0.4 s on 2 cores). One entry per `role`, format and dtype."""
    key = tuple((w.data_ptr(), tuple(w.shape), w._version) for w in weights)
    cache = owner.__dict__.setdefault("_packed_weights", {})
    hit = cache.get((role, fmt, dtype))
    if hit is None or hit[0] != key:
        packer = PACKED[fmt][0]
        hit = cache[(role, fmt, dtype)] = (key, [packer(w, dtype) for w in weights])
    return hit[1]


def packing(owner: nn.Module, linears: list[torch.Tensor], head: torch.Tensor, fmt: str, dtype: torch.dtype):
    """What a lean decoder multiplies by under `fmt` ("native", "int8", "int4"): (pack, linear,
    packed_head, head_linear), where `pack(w)` gives each of `linears` as `linear` takes it (the
    weight itself and F.linear for native; the `pack_all` copy and its product otherwise) and the
    head is packed in `HEAD_WEIGHTS` under both formats. `dtype`: the activations'."""
    if fmt not in WEIGHT_FORMATS:
        raise BadInput(f"weights: expected one of {', '.join(WEIGHT_FORMATS)}, got {fmt!r}")
    if fmt == "native":
        return (lambda w: w), F.linear, head, F.linear
    table = dict(zip(map(id, linears), pack_all(owner, linears, fmt, dtype)))
    packed_head = pack_all(owner, [head], HEAD_WEIGHTS, dtype, "head")[0]
    return (lambda w: table[id(w)]), PACKED[fmt][1], packed_head, PACKED[HEAD_WEIGHTS][1]


@torch.no_grad()
def round_linears(linears: list[nn.Linear], owner: nn.Module, head_attr: str, embedding: torch.Tensor, weights: str):
    """Each of `linears` replaced, in place, by its `weights` rounding (`Int8Weight.rounded` /
    `Int4Weight.rounded`, in the weight's dtype), and the head `getattr(owner, head_attr)` by its
    `HEAD_WEIGHTS` rounding; a head tied to `embedding` gets a rounded copy of its own, leaving
    the embedding's rows as they are."""
    pack, _ = PACKED[weights]
    for m in linears:
        m.weight.copy_(pack.rounded(m.weight).to(m.weight.dtype))
    head = getattr(owner, head_attr)
    rounded = PACKED[HEAD_WEIGHTS][0].rounded(head.weight).to(head.weight.dtype)
    if head.weight is embedding:
        head.weight = nn.Parameter(rounded, requires_grad=False)
    else:
        head.weight.copy_(rounded)
