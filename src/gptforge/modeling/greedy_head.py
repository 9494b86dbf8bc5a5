"""The exact int8 screen of a language model's head for greedy decoding on the CPU
(`GreedyHead`), and the argmax helpers it and the decoders share: used by `decoding.generate`
(gptforge's GPT) and `llama_decoding.generate_llama` (Llama-family Hugging Face models). It
imports only torch and numpy.
"""

from __future__ import annotations

import numpy as np
import torch


class GreedyHead:
    """The argmax of `weight @ x` (the next greedy token) for one float32 hidden state on the
    CPU, reading an int8 copy of the head instead of the float32 one, and still the exact
    argmax (ties to the lowest index).

    Decoding at batch 1 is memory-bound: each token reads every weight once, and GPT-2's
    (50257, 768) float32 head is 154 MB of the model's 500. Greedy decoding needs only the
    index of the largest logit, so:

    1. screen: approximate logits from a per-row int8 copy, w ~ s·q with s a bfloat16 scale
       (`torch._weight_int8pack_mm`, x rounded to bfloat16, bfloat16 out): a quarter of the
       bytes;
    2. bound: every approximate logit is within `err` of the exact x·w (below), so only rows
       whose approximation is within 2·err of the top one can hold the maximum;
    3. verify: the exact logits of those candidate rows, in float64, and their argmax (the
       lowest index on a tie, as torch.argmax).

    The error bound, for a row w = s·q + e (|e| <= E = max(s)·(1/2 + 127·2^-24): rounding to
    the nearest integer, plus float32's rounding of w/s) and x = x_b + r (x_b = bfloat16(x),
    r computed per call):
        |x·w - out| <= |r·w| + |x_b·e| + |x_b·(s·q) - out|
                    <= ||r||_1·max|w| + ||x_b||_1·E + 2^-7·max|out|/(1 - 2^-7) + acc
    where the third term is the kernel's own rounding (bfloat16 output, measured <= 2^-8
    relative, taken as 2^-7) and `acc` the float32 accumulation of C products,
    C·2^-24·127·max(s)·||x_b||_1. All terms are upper bounds, so the true maximum is always
    among the candidates. When there are none (non-finite values) or more than MAX_CANDIDATES,
    `argmax` returns None and the caller computes the full float32 logits. The kernel's
    rounding is an assumption about torch's implementation, so each new copy first checks it
    on a probe (`_kernel_within_bound`); where it does not hold, there is no screen.

    One copy per model, remade when the head changes (an optimizer step), made on first use:
    ~7 ms for the tiny config, ~40 ms for GPT-2 124M (2 CPU cores), against ~0.1 ms and ~3 ms
    saved per token. The screen applies only where it pays: the CPU, float32, batch 1, and
    torch providing the int8 kernel.
    """

    MAX_CANDIDATES = 1024

    def __init__(self, weight: torch.Tensor, chunk_rows: int = 1024):
        w = weight.detach()
        q = torch.empty(w.shape, dtype=torch.int8)
        scale = torch.empty(w.size(0), dtype=torch.bfloat16)
        amax = torch.empty(w.size(0))
        # Row blocks of ~3 MB (GPT-2): each is read from memory once and stays in cache for
        # its max, its scale and its quantization; whole-head passes would be 3x slower.
        for i in range(0, w.size(0), chunk_rows):
            rows = w[i : i + chunk_rows]
            a = amax[i : i + chunk_rows]
            torch.amax(rows.abs(), dim=1, out=a)
            # The scale rounded UP to bfloat16, so that |w / s| <= 127 and nothing is clamped:
            # then |w - s·q| <= s/2 plus the float32 rounding of w / s (<= 127·2^-24·s).
            b = to_bf16((a / 127).clamp_min(torch.finfo(torch.float32).tiny), up=True)
            scale[i : i + chunk_rows] = b
            q[i : i + chunk_rows] = torch.round(rows / b.float()[:, None])
        smax = float(scale.float().max())
        self.err_w = smax * (0.5 + 127 * 2.0**-24)
        self.q = q
        self.scale = scale
        self.weight = w
        self.w_max = float(amax.max())
        self.acc = w.size(1) * 2.0**-24 * 127 * smax

    @staticmethod
    def usable(weight: torch.Tensor) -> bool:
        return weight.device.type == "cpu" and weight.dtype == torch.float32 and hasattr(torch, "_weight_int8pack_mm")

    @classmethod
    def for_model(cls, model, build: bool = True) -> GreedyHead | None:
        """The screen of `model`'s head, kept on the model (so it lives as long as the model)
        until the head changes: another tensor, or an in-place update (its version counter).
        With build=False, only an up-to-date copy already made is returned."""
        return cls.for_weight(model, model.lm_head.weight[: model.config.n_vocab], build)

    @classmethod
    def for_weight(cls, owner, weight: torch.Tensor, build: bool = True) -> GreedyHead | None:
        """The screen of the head `weight`, kept on `owner` (a model) as `for_model` keeps it."""
        if not cls.usable(weight):
            owner.__dict__.pop("_greedy_head", None)
            return None
        key = (weight.data_ptr(), tuple(weight.shape), weight._version)
        cached = owner.__dict__.get("_greedy_head")
        if cached is None or cached[0] != key:
            if not build:
                return None
            head = cls(weight)
            cached = owner.__dict__["_greedy_head"] = (key, head if head._kernel_within_bound() else None)
        return cached[1]

    def _kernel_within_bound(self, rows: int = 4096) -> bool:
        """Whether torch's int8 kernel rounds as the bound assumes: on the first `rows` rows and
        two random inputs, |out - x_b·(s·q)| <= 2^-7·|x_b·(s·q)| + acc, the exact value in
        float64."""
        q, scale = self.q[:rows], self.scale[:rows]
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            xb = torch.randn(1, q.size(1), generator=g).to(torch.bfloat16)
            try:
                out = torch._weight_int8pack_mm(xb, q, scale)[0].double()
            except RuntimeError:
                return False
            exact = (q.double() @ xb[0].double()) * scale.double()
            tol = 2.0**-7 * exact.abs() + self.acc * float(xb.double().abs().sum())
            if not bool(((out - exact).abs() <= tol).all()):
                return False
        return True

    def argmax(self, x: torch.Tensor) -> int | None:
        """x (C,) float32 -> the index of the largest x·w over the rows, or None (see above).
        The bookkeeping is in NumPy, whose calls on a few hundred or thousand numbers cost
        ~1 us against torch's ~5-60 us (nonzero over 50257 flags: ~60 us): at the tiny config
        the int8 product itself is only ~300 us."""
        xn = x.numpy()
        if not np.isfinite(xn).all():
            return None
        xb = x.to(torch.bfloat16)
        out = torch._weight_int8pack_mm(xb.view(1, -1), self.q, self.scale)[0]  # the probe ran it
        lo, hi = torch.aminmax(out)
        top = float(hi)
        xb32 = xb.float().numpy()
        n_xb = float(np.abs(xb32).sum())
        err = (
            float(np.abs(xn - xb32).sum()) * self.w_max
            + n_xb * (self.err_w + self.acc)
            + 2.0**-7 * max(top, -float(lo)) / (1 - 2.0**-7)
        )
        # Rows whose screened logit reaches top - 2·err; the threshold is rounded down to a
        # bfloat16 value so that comparing in bfloat16 loses no row. (An overflow to inf in the
        # product makes err inf or NaN: then there are no candidates, and the answer is None.)
        threshold = float(to_bf16(torch.tensor(top - 2 * err), up=False))
        cand = np.flatnonzero((out >= threshold).numpy())
        if not 0 < cand.size <= self.MAX_CANDIDATES:
            return None
        rows = self.weight.numpy()[cand].astype(np.float64)
        return int(cand[int(np.argmax(rows @ xn.astype(np.float64)))])


def to_bf16(values: torch.Tensor, *, up: bool) -> torch.Tensor:
    """float32 values rounded to bfloat16 toward +inf (up) or -inf, not to the nearest: the
    error bounds above need to know which side of a value its bfloat16 lies. NaN stays NaN."""
    b = values.to(torch.bfloat16)
    off = b.float() < values if up else b.float() > values
    return torch.where(off, torch.nextafter(b, torch.tensor(float("inf" if up else "-inf"), dtype=torch.bfloat16)), b)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first maximum, as torch.argmax). On the CPU through NumPy: torch's CPU
    argmax over 50257 columns takes ~90 us, NumPy's vectorized one ~6 us, and a batch-1 decode
    step of the tiny model costs only ~1.2 ms in all."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return torch.argmax(logits, dim=-1)
