"""Export a gptforge checkpoint as a Hugging Face folder (`gptforge export --checkpoint --out`).

The folder loads with `AutoModelForCausalLM.from_pretrained(out)` and
`AutoTokenizer.from_pretrained(out)`: HF's config.json, model.safetensors (HF layout, see
`hf_convert.to_hf`), generation_config.json, and the GPT-2 tokenizer files: vocab.json (OpenAI's
encoder.json), merges.txt (vocab.bpe), tokenizer.json, tokenizer_config.json and
special_tokens_map.json with `<|endoftext|>` as bos/eos/unk. The whole folder appears at once
(io.atomic_dir): a failure leaves the previous folder, or none, never half of one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gptforge.errors import BadInput, SourceUnreachable
from gptforge.io import atomic_dir, write_json
from gptforge.modeling.hf_convert import to_hf
from gptforge.modeling.tokenizer import EOT_TOKEN, load_tokenizer
from gptforge.modeling.weights import load_model

TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def export_hf(checkpoint_dir: str | Path, out_dir: str | Path, tokenizer_path: str | None) -> Path:
    """Write `out_dir` from the checkpoint folder; `tokenizer_path` is a folder with encoder.json
    and vocab.bpe, or None for the hub's `gpt2` tokenizer. Returns the out path."""
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    ckpt, out = checkpoint_dir.resolve(), out_dir.resolve()
    if out == ckpt or out in ckpt.parents:
        # atomic_dir replaces the out folder as a whole: that would delete the checkpoint.
        raise BadInput(f"export folder {out_dir} would replace the checkpoint {checkpoint_dir}; choose another --out")
    model = load_model(checkpoint_dir)
    n_vocab = model.config.n_vocab
    if tokenizer_path is not None:
        vocab_size = _check_tokenizer_folder(tokenizer_path)
        if vocab_size > n_vocab:
            raise BadInput(
                f"tokenizer.path {tokenizer_path} has {vocab_size} tokens, more than the model's "
                f"n_vocab={n_vocab} ({checkpoint_dir / 'config.json'})"
            )
    hf = to_hf(model)
    # A generation never runs past the model's positions: transformers' text-generation pipeline
    # otherwise asks for 256 new tokens, more than a small model's window holds.
    hf.generation_config.max_length = model.config.block_size
    with atomic_dir(out_dir) as tmp:
        hf.save_pretrained(tmp)
        if tokenizer_path is not None:
            _write_tokenizer_from_files(Path(tokenizer_path), tmp, model.config.block_size)
        else:
            _write_tokenizer_from_hub(tmp, model.config.block_size)
    return out_dir


def hf_tokenizer(tokenizer_path: str | None, block_size: int):
    """The run's tokenizer (`tokenizer.path`) as a transformers tokenizer, for libraries that take
    one (trl's trainers): a folder with OpenAI's encoder.json and vocab.bpe, or None for the hub's
    `gpt2`, written as `export_hf` writes it and loaded back; a `.tiktoken` rank file through
    transformers' TikTokenConverter, with `<|endoftext|>` after the ranks as tiktoken puts it."""
    import tempfile

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if tokenizer_path is not None and Path(tokenizer_path).is_file():
        from transformers.convert_slow_tokenizer import TikTokenConverter

        load_tokenizer(tokenizer_path)  # the rank file's own checks, one line each
        converted = TikTokenConverter(vocab_file=str(tokenizer_path), extra_special_tokens=[EOT_TOKEN]).converted()
        return PreTrainedTokenizerFast(tokenizer_object=converted, model_max_length=block_size, **_special_tokens())
    with tempfile.TemporaryDirectory(prefix="gptforge-tokenizer-") as tmp:
        if tokenizer_path is not None:
            _check_tokenizer_folder(tokenizer_path)
            _write_tokenizer_from_files(Path(tokenizer_path), Path(tmp), block_size)
        else:
            _write_tokenizer_from_hub(Path(tmp), block_size)
        return AutoTokenizer.from_pretrained(tmp)


def _check_tokenizer_folder(path: str) -> int:
    """A folder with OpenAI's encoder.json + vocab.bpe (load_tokenizer checks the pair);
    returns the vocabulary size."""
    p = Path(path)
    if not p.is_dir():
        raise BadInput(f"tokenizer.path {path}: export needs a folder with encoder.json and vocab.bpe")
    return load_tokenizer(str(p)).n_vocab


def _special_tokens() -> dict:
    return {"bos_token": EOT_TOKEN, "eos_token": EOT_TOKEN, "unk_token": EOT_TOKEN}


def _write_tokenizer_from_files(src: Path, dst: Path, block_size: int) -> None:
    shutil.copyfile(src / "encoder.json", dst / "vocab.json")
    shutil.copyfile(src / "vocab.bpe", dst / "merges.txt")
    write_json(
        dst / "tokenizer_config.json",
        {
            "tokenizer_class": "GPT2Tokenizer",
            **_special_tokens(),
            "add_prefix_space": False,
            "model_max_length": block_size,
        },
    )
    # Load what we wrote, as a user would, and save it back: this adds tokenizer.json (the fast
    # tokenizer in one file) and proves the folder loads before it is published.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(dst))
    tok.save_pretrained(str(dst))
    _finish_tokenizer(dst, block_size)


def _write_tokenizer_from_hub(dst: Path, block_size: int) -> None:
    try:
        from transformers import GPT2TokenizerFast

        tok = GPT2TokenizerFast.from_pretrained("gpt2")
        if len(tok) < 256:
            # transformers 5 offline with nothing cached returns an empty tokenizer, no error.
            raise OSError("no tokenizer files found (offline, and not in the cache)")
    except Exception as e:  # offline, hub errors, no cache
        reason = " ".join(f"{type(e).__name__}: {e}".split())
        reason = reason if len(reason) <= 160 else reason[:157] + "..."
        raise SourceUnreachable(
            f"cannot download the gpt2 tokenizer from the Hugging Face hub ({reason}); "
            "set tokenizer.path to a folder with encoder.json and vocab.bpe"
        ) from None
    tok.model_max_length = block_size
    tok.save_pretrained(str(dst))
    _finish_tokenizer(dst, block_size)


def _finish_tokenizer(dst: Path, block_size: int) -> None:
    """Files some loaders still look for: special_tokens_map.json, and vocab.json/merges.txt
    (newer transformers saves only tokenizer.json; they are its BPE model's two halves)."""
    write_json(dst / "special_tokens_map.json", _special_tokens())
    if (dst / "vocab.json").is_file() and (dst / "merges.txt").is_file():
        return
    bpe = json.loads((dst / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    write_json(dst / "vocab.json", bpe["vocab"])
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]
    (dst / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
