"""The models of benchmarks/bench_serve.py, random weights from `--seed`: bench_generate's tiny GPT
(optionally with another block size, 2,048 for `tiny-2048`) and a Hugging Face Llama folder of
about its cost, saved with the GPT-2 tokenizer and a generation config that samples
(`SAMPLED_TEMPERATURE`, `HF_TOP_K`); and the `ceiling` measure, what the tiny GPT reaches without a
server: bench_generate's warm direct `generate` and the server's model step alone."""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_generate import CONFIGS, timed_interleaved

from gptforge.modeling.decoding import generate
from gptforge.modeling.gpt import GPT

SAMPLED_TEMPERATURE = 0.8
HF_TOP_K = 50  # transformers' default top_k when sampling; sent to gptforge serve as well


def tiny_model(args, block_size: int | None = None) -> GPT:
    """bench_generate's tiny GPT from `--seed` (as bench_generate: the same seed, the same
    weights), optionally with another block size."""
    torch.manual_seed(args.seed)
    cfg = CONFIGS["tiny"] if block_size is None else dataclasses.replace(CONFIGS["tiny"], block_size=block_size)
    return GPT(cfg).eval()


def tokenizer_folder(args) -> Path:
    """The GPT-2 BPE files (encoder.json + vocab.bpe) for the Llama folder's tokenizer: the
    project's tokenizer when it is such a folder, else the embedded sample."""
    if args.tokenizer_path and (Path(args.tokenizer_path) / "encoder.json").is_file():
        return Path(args.tokenizer_path)
    from gptforge.samples import resolve

    return Path(resolve("sample://gpt2_tokenizer"))


def make_llama_folder(folder: Path, args) -> dict:
    """A random Llama of about the tiny GPT's cost, saved with the GPT-2 tokenizer in `folder`."""
    import shutil

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    shape = dict(
        vocab_size=50257,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=50256,
        eos_token_id=50256,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    # Sampling settings of the folder: transformers serve samples only where the generation
    # config says do_sample (a request's temperature alone does not switch it on).
    model.generation_config.do_sample = True
    model.generation_config.temperature = SAMPLED_TEMPERATURE
    model.generation_config.top_k = HF_TOP_K
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder))
    src = tokenizer_folder(args)
    with tempfile.TemporaryDirectory() as tmp:
        # In a folder of its own, where a GPT-2 config.json makes AutoTokenizer pick GPT-2's class.
        shutil.copy(src / "encoder.json", Path(tmp) / "vocab.json")
        shutil.copy(src / "vocab.bpe", Path(tmp) / "merges.txt")
        (Path(tmp) / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        AutoTokenizer.from_pretrained(tmp).save_pretrained(str(folder))
    return {
        **shape,
        "architecture": "LlamaForCausalLM",
        "params": sum(p.numel() for p in model.parameters()),
        "generation_config": {"do_sample": True, "top_k": HF_TOP_K},
    }


# ---------------------------------------------------------------------------------------------
# ceiling: direct generate, the server's step alone


def direct_generate(model: GPT, ids: list[int], args, batch_sizes: list[int]) -> dict:
    """bench_generate's warm greedy measurement, batch 1 and the other levels' batch sizes."""
    n = args.max_tokens
    prompt = torch.tensor([ids])
    fns = {f"b{b}": (lambda b=b: generate(model, prompt.repeat(b, 1), n, temperature=0)) for b in batch_sizes}
    res = timed_interleaved(fns, args.repeats)
    out = {}
    for name, (median, times, tokens) in res.items():
        b = int(name[1:])
        out[name] = {
            "batch": b,
            "tokens_per_sec": round(b * n / median, 2),
            "median_s": round(median, 4),
            "times_s": [round(t, 4) for t in times],
        }
    out["new_ids"] = res["b1"][2][0, len(ids) :].tolist()
    return out


def step_alone(model: GPT, ids: list[int], args, batch_sizes: list[int]) -> dict:
    """The server's model step without the server, timed in this process (median of 48 steps
    after 8): `serve.gpt_backend.GPTBackend` decoding `batch_sizes` rows and picking each row's
    greedy token as the engine does (`decode_greedy` for a single row where the backend has it,
    else `decode` and argmax), once with rows of one length (the backend's batch path) and once
    with rows at different positions (its ragged path, what staggered clients give); and the
    head's part alone (the backend's `logits`, or its int8 `screen` for a single greedy row).
    Pieces of the per-token cost, for the report; the backend is the server's internal API, so
    a change there is reported, not fatal."""
    from gptforge.modeling.gpt import head_logits

    def median_ms(fn, n=48, warm=8):
        for _ in range(warm):
            fn()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return round(1000 * statistics.median(ts), 3)

    from gptforge.serve.gpt_backend import GPTBackend

    def add(backend, prompt_ids: list[int]) -> torch.Tensor:  # a row for a prompt: its next-token logits
        backend.open_row()
        return backend.forward([(backend.rows - 1, prompt_ids)])[0]

    def decode(backend, toks: list[int]) -> torch.Tensor:  # one token per row: (rows, vocab) logits
        return backend.forward([(i, [t]) for i, t in enumerate(toks)])

    out: dict = {}
    for b in batch_sizes:
        row: dict = {}
        try:
            backend = GPTBackend(model, max(args.max_batch, b))
            screen = getattr(backend, "screen", None) if b == 1 and hasattr(backend, "decode_greedy") else None
            x = torch.randn(b, model.config.n_embd)
            if screen is not None:
                row["head"] = "int8 screen (GreedyHead)"
                head = lambda: screen.argmax(x[0])  # noqa: E731
            elif hasattr(backend, "logits"):
                row["head"] = "backend.logits"
                head = lambda: backend.logits(x)  # noqa: E731
            else:
                row["head"] = "model.head_logits"
                head = lambda: head_logits(x, backend.head)  # noqa: E731
            with torch.inference_mode():
                row["head_ms"] = median_ms(head)
            for kind in ("aligned", "ragged") if b > 1 else ("aligned",):
                backend = GPTBackend(model, max(args.max_batch, b))
                # ragged: prompts of different lengths, so the rows sit at different positions
                toks = [
                    int(add(backend, ids + ids[: r % len(ids)] if kind == "ragged" else ids).argmax()) for r in range(b)
                ]
                state = {"toks": toks}

                def step():
                    backend.keep(list(range(b)))
                    if b == 1 and hasattr(backend, "decode_greedy"):
                        state["toks"] = [backend.decode_greedy(state["toks"][0])]
                    else:
                        state["toks"] = decode(backend, state["toks"]).argmax(dim=-1).tolist()

                row[f"step_{kind}_ms"] = median_ms(step)
        except Exception as e:  # noqa: BLE001 (the server's API moved: say so in the report)
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        out[f"b{b}"] = row
    return out
