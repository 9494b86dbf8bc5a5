"""The GPT-2 BPE tokenizer through tiktoken, from its download cache or from local files.

`tokenizer.path` may name a folder with OpenAI's `encoder.json` + `vocab.bpe` (what
`tiktoken.get_encoding("gpt2")` downloads), or a `.tiktoken` rank file. With no path, tiktoken's
own `gpt2` encoding is used, which needs the network (or tiktoken's cache) the first time.
A Hugging Face model folder (a `tokenizer.json`, no `encoder.json`: SmolLM2's, a Llama's) gives
its own tokenizer behind the same methods (`hf_causal.HFTokenizer`, documents separated by its
`<|endoftext|>` where it has one), so `prepare pretrain` and `pretrain` continue a model on its
own vocabulary (`pretrain.init_from` of that folder).
"""

from __future__ import annotations

import functools
from pathlib import Path

import tiktoken
import tiktoken.load

from gptforge.errors import BadInput, SourceUnreachable

EOT_TOKEN = "<|endoftext|>"
EOT_ID = 50256
UINT16_LIMIT = 1 << 16

# GPT-2's pre-tokenizer split (tiktoken's r50k/gpt2 pattern).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def describe(path: str | None) -> str:
    if path and _is_hf_folder(Path(path)):
        return f"Hugging Face tokenizer from {path}"
    return f"gpt2 BPE from {path}" if path else "tiktoken:gpt2"


def _is_hf_folder(p: Path) -> bool:
    return p.is_dir() and (p / "tokenizer.json").is_file() and not (p / "encoder.json").is_file()


def _hf_tokenizer(p: Path):
    """A Hugging Face folder's tokenizer (see the module's docstring), read offline."""
    from gptforge.modeling.hf_causal import HFTokenizer

    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # a damaged tokenizer.json, an unknown tokenizer class, ...
        raise BadInput(f"tokenizer.path {p}: cannot read its tokenizer ({' '.join(str(e).split())[:160]})") from None
    separator = tok.get_vocab().get(EOT_TOKEN)
    if separator is None and tok.eos_token_id is None:
        raise BadInput(f"tokenizer.path {p}: neither {EOT_TOKEN} nor an eos token to separate documents with")
    return HFTokenizer(tok, eot_id=separator)


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str | None = None):
    """tiktoken's Encoding, or for a Hugging Face folder an `hf_causal.HFTokenizer` with its methods."""
    if path is None:
        try:
            return tiktoken.get_encoding("gpt2")
        except Exception as e:  # tiktoken raises requests/urllib errors of several kinds
            raise SourceUnreachable(
                f"cannot download tiktoken's gpt2 tokenizer files ({type(e).__name__}); "
                "set tokenizer.path to a local folder with encoder.json and vocab.bpe"
            ) from None
    p = Path(path)
    if _is_hf_folder(p):
        return _hf_tokenizer(p)
    if p.is_dir():
        enc_json, bpe = p / "encoder.json", p / "vocab.bpe"
        missing = [f.name for f in (enc_json, bpe) if not f.is_file()]
        if missing:
            raise BadInput(
                f"tokenizer.path {path}: missing {', '.join(missing)} "
                "(needs encoder.json and vocab.bpe, or a Hugging Face tokenizer.json)"
            )
        try:
            ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
                vocab_bpe_file=str(bpe), encoder_json_file=str(enc_json)
            )
        except Exception as e:
            raise BadInput(
                f"tokenizer.path {path}: not a GPT-2 encoder.json/vocab.bpe pair ({type(e).__name__}: {e})"
            ) from None
    elif p.is_file():
        try:
            ranks = tiktoken.load.load_tiktoken_bpe(str(p))
        except Exception as e:
            raise BadInput(f"tokenizer.path {path}: not a .tiktoken rank file ({type(e).__name__}: {e})") from None
    else:
        raise BadInput(f"tokenizer.path not found: {path}")
    if not ranks:
        raise BadInput(f"tokenizer.path {path}: empty vocabulary")
    eot = max(ranks.values()) + 1  # GPT-2: 50256 BPE ranks, then <|endoftext|> = 50256
    try:
        return tiktoken.Encoding(
            name=f"gpt2@{p}", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOT_TOKEN: eot}
        )
    except Exception as e:
        raise BadInput(f"tokenizer.path {path}: cannot build the tokenizer ({type(e).__name__}: {e})") from None


def check_fits_uint16(enc: tiktoken.Encoding, path: str | None = None) -> None:
    """Token shards are uint16: refuse a vocabulary with ids that do not fit."""
    if enc.n_vocab > UINT16_LIMIT:
        raise BadInput(
            f"tokenizer {describe(path)} has {enc.n_vocab} tokens, more than uint16 shards hold ({UINT16_LIMIT})"
        )
