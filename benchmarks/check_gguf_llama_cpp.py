"""GGUF files gptforge writes, read by llama.cpp itself: its tokenizer and its forward against the
source model's.

    benchmarks/llama_cpp_env.sh                    # once: builds .venv-llama-cpp (about 8 minutes)
    python benchmarks/check_gguf_llama_cpp.py [--hf DIR ...] [--gptforge DIR] [--quants f16,q8_0]
        [--out docs/results/gguf_llama_cpp.json]

For each model (by default the quickstart's fine-tuned SmolLM2, checkpoints/instruct_smollm2/final,
and its fine-tuned GPT, checkpoints/instruct/final: `make run` writes both) and each
quantization, `export_gguf` writes the file, and llama.cpp (llama-cpp-python in its own
environment, through benchmarks/llama_cpp_probe.py) reads it:

- token ids: 200 strings (lines of this repository's docs/, lines of its Python code, and
  unicode: accents, CJK, Cyrillic, emoji) tokenized by llama.cpp and by the source tokenizer
  (the Hugging Face tokenizer of the folder; tiktoken for gptforge's GPT), no BOS, special
  tokens as plain text on both sides; the count of strings whose ids are equal.
- the next-token argmax at every position of a held-out text (docs/gguf-out.md, which neither
  model trained on; in windows of the model's context for the GPT) from llama.cpp's logits and
  from the source model's in float32; the share of positions where they agree, and at each
  disagreement the source's gap between its first and second logit (a near-tie flips under
  llama.cpp's different rounding of activations).

The goal (issue 47): on f16, equal ids on all 200 strings and agreement >= 95%.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("LLAMA_CPP_VENV", ROOT / ".venv-llama-cpp"))
PROBE = Path(__file__).resolve().with_name("llama_cpp_probe.py")
UNICODE = [
    "naïve café, crème brûlée and Ångström",
    "東京は日本の首都です。",
    "Привет, как дела?",
    "emoji: 🙂👍🏽🚀 and ✅ ❌",
    "Ελληνικά: καλημέρα κόσμε",
    "العربية: مرحبا بالعالم",
    "हिन्दी: नमस्ते दुनिया",
    "한국어: 안녕하세요 세계",
    "math: ∑ x² ≤ ∞, α→β, ½ × ¾",
    "tabs\tand  double  spaces,\nnewlines\n\nand trailing space ",
    "ß, ø, ł, ğ, ş, ć, ž",
    "   leading spaces and <html> tags </html> &amp;",
    "numbers 1234567890, 3.14159, -42, 1e-5 and 2026-11-28",
    "quotes: “curly” ‘single’ «guillemets» — dashes – …",
    "zero\u200bwidth and non\u00a0breaking",
    "<|endoftext|> and <|im_start|> written as text",
]
SMOLLM2 = ROOT / "checkpoints/instruct_smollm2/final"
GPT = ROOT / "checkpoints/instruct/final"


def strings(n: int = 200) -> list[str]:
    """`n` strings: docs lines, code lines and the unicode ones, evenly picked, fixed order."""
    docs, code = [], []
    for path in sorted((ROOT / "docs").rglob("*.md")):
        docs += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    for path in sorted((ROOT / "src/gptforge").rglob("*.py")):
        code += [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    n_code = (n - len(UNICODE)) // 4
    n_docs = n - len(UNICODE) - n_code
    pick = lambda lines, k: [lines[i * len(lines) // k] for i in range(k)]  # noqa: E731
    return pick(docs, n_docs) + pick(code, n_code) + UNICODE


def held_out_text() -> str:
    return (ROOT / "docs/gguf-out.md").read_text(encoding="utf-8")


class Source:
    """The model a file was exported from: its tokenizer and its float32 next-token argmax."""

    def __init__(self, kind: str, folder: Path, tokenizer_path: str | None):
        import torch

        self.kind, self.folder = kind, folder
        if kind == "hf":
            from transformers import AutoModelForCausalLM, AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(folder)
            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            self.context = 512
        else:
            from gptforge.modeling.tokenizer import load_tokenizer
            from gptforge.modeling.weights import load_model

            self.enc = load_tokenizer(tokenizer_path)
            self.model = load_model(folder).eval()
            self.context = self.model.config.block_size

    def encode(self, text: str) -> list[int]:
        if self.kind == "hf":
            return self.tok(text, add_special_tokens=False, split_special_tokens=True).input_ids
        return self.enc.encode_ordinary(text)

    def next_tokens(self, ids: list[int]):
        """(argmax, gap between the first and second logit) at every position of `ids`."""
        import torch

        with torch.no_grad():
            x = torch.tensor([ids])
            logits = self.model(x).logits if self.kind == "hf" else self.model(x)[0]
        top = logits[0].float().topk(2, dim=-1)
        return top.indices[:, 0].tolist(), (top.values[:, 0] - top.values[:, 1]).tolist()


def probe(gguf: Path, texts: list[str], ids: list[int]) -> dict:
    python = VENV / "bin/python"
    if not python.is_file():
        sys.exit(f"error: {python} not found: build it first with benchmarks/llama_cpp_env.sh")
    request = json.dumps({"gguf": str(gguf), "strings": texts, "ids": ids, "threads": os.cpu_count() or 1})
    out = subprocess.run([str(python), str(PROBE)], input=request, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        sys.exit(f"error: llama.cpp could not read {gguf}: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout)


def check(name: str, source: Source, gguf: Path, texts: list[str]) -> dict:
    held = source.encode(held_out_text())
    windows = [held[i : i + source.context] for i in range(0, len(held), source.context)][:4]
    windows = [w for w in windows if len(w) > 1]
    agree, flips, positions, ids_equal, mismatched = 0, [], 0, 0, []
    t0 = time.perf_counter()
    for k, window in enumerate(windows):
        got = probe(gguf, texts if k == 0 else [], window)
        if k == 0:
            for text, theirs in zip(texts, got["token_ids"]):
                ours = source.encode(text)
                ids_equal += ours == theirs
                if ours != theirs and len(mismatched) < 5:
                    mismatched.append({"text": text, "source": ours[:20], "llama_cpp": theirs[:20]})
            version = got["llama_cpp"]
        want, gaps = source.next_tokens(window)
        for p, (a, b) in enumerate(zip(want, got["argmax"])):
            positions += 1
            agree += a == b
            if a != b:
                flips.append(round(gaps[p], 4))
    return {
        "model": name,
        "gguf": gguf.name,
        "gguf_mb": round(gguf.stat().st_size / 1e6, 1),
        "llama_cpp_python": version,
        "strings": len(texts),
        "token_ids_equal": ids_equal,
        "mismatched_examples": mismatched,
        "positions": positions,
        "argmax_agree": agree,
        "argmax_agreement": round(agree / positions, 4),
        "flip_gaps": sorted(flips),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", action="append", default=None, help="a Hugging Face folder (repeatable; '' for none)")
    ap.add_argument("--gptforge", default=str(GPT), help="a gptforge checkpoint folder ('' for none)")
    ap.add_argument(
        "--tokenizer", default=None, help="the gptforge checkpoint's tokenizer.path (default: params.yaml's)"
    )
    ap.add_argument("--quants", default="f16,q8_0")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from gptforge.config.load import load_config
    from gptforge.modeling.gguf_out import export_gguf

    if args.tokenizer is None:
        args.tokenizer = load_config(ROOT / "params.yaml").tokenizer.path

    targets = [("hf", Path(p)) for p in (args.hf if args.hf is not None else [str(SMOLLM2)]) if p]
    if args.gptforge:
        targets.append(("gptforge", Path(args.gptforge)))
    texts = strings()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gguf-llama-cpp-") as tmp:
        for kind, folder in targets:
            if not folder.is_dir():
                sys.exit(f"error: {folder} not found (make run writes it)")
            source = Source(kind, folder, args.tokenizer)
            name = f"{folder.parent.name}/{folder.name}"
            for quant in args.quants.split(","):
                gguf = export_gguf(
                    folder, Path(tmp) / quant / f"{folder.parent.name}-{quant}.gguf", quant, args.tokenizer
                )
                row = check(name, source, gguf, texts)
                row["quant"] = quant
                rows.append(row)
                print(
                    f"{name} {quant}: ids equal on {row['token_ids_equal']}/{row['strings']} strings, "
                    f"argmax agrees at {row['argmax_agree']}/{row['positions']} positions "
                    f"({100 * row['argmax_agreement']:.1f}%); flips' source gaps {row['flip_gaps'][:8]}",
                    file=sys.stderr,
                )
    result = {
        "check": "gguf_llama_cpp",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
        "command": "python benchmarks/check_gguf_llama_cpp.py " + " ".join(sys.argv[1:]),
        "rows": rows,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
