"""GGUF out (gptforge.modeling.gguf_out): a gptforge folder -> one .gguf file and a Modelfile.

Read back by an independent reader, transformers' own GGUF loader (`from_pretrained(DIR,
gguf_file=NAME)`, through the gguf package's reader and its own reverse of llama.cpp's layouts):
tiny random Llama and Qwen2 with grouped-query attention and gptforge's own GPT (GGUF's gpt2) give the
source's logits within 1e-2 relative at every position in f16; the tokenizer transformers builds
from the file's fields encodes lines of prose, unicode and code to the source tokenizer's ids; a
q8_0 file stays near. SmolLM2 (a GGUF in, then out): f16 the same greedy answers, q8_0 the same
on 2 of 3 and a held-out perplexity within 2%. Bad input is one line, exit 2, nothing written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from cli_support import cli_env, last_error_line, run_cli, snapshot
from hf_models import make_tiny_causal_lm
from test_export import checkpoint as gpt_checkpoint
from test_gguf_in import PROMPTS

from gptforge.errors import BadInput
from gptforge.finetune.templates import ollama_template
from gptforge.modeling.gguf_out import export_gguf

# Each exports and loads models, or runs commands as fresh processes too: seconds each.
pytestmark = pytest.mark.slow

TEXTS = [
    "Rivers carry water from the mountains to the sea, shaping valleys on the way.",
    "Ünïcödé: naïve café, 東京, Привет, emoji 🙂 and tabs\tand  double  spaces.",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # code, 2024-11-28\n",
    "   leading spaces, numbers 1234567 and 3.14159, and <html> tags </html>",
]
HELD_OUT = (
    "The water cycle moves water between the oceans, the air and the land. The sun warms the "
    "sea, water rises as vapour, cools into clouds and falls again as rain or snow."
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Llama and Qwen2 (4 heads, 2 key/value heads, untied head) with GPT-2's
    tokenizer and a ChatML template (tests/hf_models.py)."""
    tmp = tmp_path_factory.mktemp("hf")
    return {arch: make_tiny_causal_lm(tmp / arch, arch, seed=1) for arch in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def llama_folder(folders) -> Path:
    return folders["llama"]


def _read_back(path: Path, **config):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, **config
    ).eval()
    return model, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _relative_error(want: torch.Tensor, got: torch.Tensor) -> float:
    """The largest, over positions, of the logits' largest difference over the largest logit there."""
    return ((want - got).abs().amax(-1) / want.abs().amax(-1)).max().item()


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_folder_in_f16_reads_back_with_its_logits_and_tokenizer(arch, folders, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = folders[arch]
    out = export_gguf(folder, tmp_path / "m-f16.gguf", "f16")
    assert out.is_file() and not list(tmp_path.glob("*.part"))
    source, tok = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    model, gguf_tok = _read_back(out)
    assert type(model) is type(source) and model.config.num_key_value_heads == 2
    assert gguf_tok.chat_template == tok.chat_template
    # transformers' reader splits a qwen2 file's text with Qwen2's regex whatever the file's
    # tokenizer.ggml.pre says (llama.cpp reads the field): GPT-2's BPE under a Qwen2 model is this
    # fixture's pairing only, so the token ids are compared for the llama file (GPT-2's split).
    for text in TEXTS if arch == "llama" else ():
        assert gguf_tok(text).input_ids == tok(text).input_ids, text
    ids = tok(HELD_OUT, return_tensors="pt").input_ids
    assert _relative_error(_logits(source, ids), _logits(model, ids)) < 1e-2
    modelfile = (tmp_path / "Modelfile").read_text()
    assert modelfile.startswith("FROM ./m-f16.gguf\n") and "<|im_start|>" in modelfile
    assert 'PARAMETER stop "<|endoftext|>"' in modelfile


def test_q8_0_stays_near_and_is_about_half_the_f16_file(llama_folder, tmp_path):
    f16 = export_gguf(llama_folder, tmp_path / "f16" / "m.gguf", "f16")
    q8 = export_gguf(llama_folder, tmp_path / "q8" / "m.gguf", "q8_0")
    assert 0.5 < q8.stat().st_size / f16.stat().st_size < 0.6  # 8.5 bits a weight against 16
    from gguf import GGMLQuantizationType, GGUFReader

    types = {t.name: t.tensor_type for t in GGUFReader(q8).tensors}
    assert types["blk.0.attn_q.weight"] == GGMLQuantizationType.Q8_0
    assert types["blk.0.attn_norm.weight"] == GGMLQuantizationType.F32  # 1-D tensors stay f32
    ids = torch.arange(1, 60).unsqueeze(0) * 811 % 50257
    want, got = _logits(_read_back(f16)[0], ids), _logits(_read_back(q8)[0], ids)
    assert _relative_error(want, got) < 5e-2


def test_gptforge_gpt_exports_as_gguf_gpt2(tmp_path, gpt2_tokenizer_dir):
    ours = gpt_checkpoint(tmp_path / "ckpt")
    out = export_gguf(
        tmp_path / "ckpt", tmp_path / "gpt.gguf", "f16", str(gpt2_tokenizer_dir), ollama_template("alpaca")
    )
    # transformers' reader takes GGUF's gpt2 context_length as n_ctx, not n_positions (the
    # position table's size), which llama.cpp reads from the file: given here as the model has it.
    model, gguf_tok = _read_back(out, n_positions=ours.config.block_size)
    assert type(model).__name__ == "GPT2LMHeadModel"
    ids = torch.tensor([gguf_tok("the cat sat on the mat and the dog").input_ids])
    with torch.no_grad():
        want, _ = ours(ids)
    assert _relative_error(want[..., :50257], _logits(model, ids)) < 1e-2
    modelfile = (tmp_path / "Modelfile").read_text()
    assert "### Instruction:\n{{ .Prompt }}" in modelfile and 'PARAMETER stop "<|endoftext|>"' in modelfile


def test_gptforge_llama_arch_exports_as_gguf_llama(tmp_path, gpt2_tokenizer_dir):
    """A checkpoint of `model.arch: llama` (grouped-query, untied head) goes out through its
    LlamaForCausalLM export: GGUF's llama architecture, the logits within 1e-2."""
    from gptforge.modeling.gpt import GPT, GPTConfig
    from gptforge.modeling.weights import save_model

    torch.manual_seed(0)
    config = GPTConfig(
        n_layer=2, n_head=4, n_embd=64, block_size=64, arch="llama", n_kv_head=2, bias=False, tie_embeddings=False
    )
    ours = GPT(config).eval()
    save_model(ours, tmp_path / "ckpt")
    out = export_gguf(tmp_path / "ckpt", tmp_path / "llama.gguf", "f16", str(gpt2_tokenizer_dir))
    model, gguf_tok = _read_back(out)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_key_value_heads == 2
    assert model.config.tie_word_embeddings is False
    ids = torch.tensor([gguf_tok("the cat sat on the mat and the dog").input_ids])
    with torch.no_grad():
        want, _ = ours(ids)
    assert _relative_error(want[..., :50257], _logits(model, ids)) < 1e-2


@pytest.mark.parametrize("template", ["alpaca", "phi3"])
def test_modelfile_prompts_as_training_rendered_the_instruction(template):
    """A model without a chat template: Ollama fills .Prompt with the user's message and
    .Response with nothing before it generates; the text is the prompt training rendered."""
    from types import SimpleNamespace

    from gptforge.finetune.templates import render
    from gptforge.modeling.gguf_out import ollama_modelfile

    tokenizer = SimpleNamespace(chat_template=None, eos_token="<|endoftext|>")
    modelfile = ollama_modelfile("m.gguf", tokenizer, ollama_template(template))
    go = modelfile.split('TEMPLATE """', 1)[1].split('"""', 1)[0]
    instruction = "Name a colour of the sky."
    filled = go.replace("{{ .Prompt }}", instruction).replace("{{ .Response }}", "")
    assert filled == render({"instruction": instruction, "output": "Blue."}, template)[0]
    stops = [line.split('"')[1] for line in modelfile.splitlines() if line.startswith("PARAMETER stop")]
    assert stops == {"alpaca": ["### Instruction:"], "phi3": ["<|end|>", "<|user|>"]}[template] + ["<|endoftext|>"]
    with pytest.raises(BadInput, match="alpaca or phi3"):
        ollama_template("chat")
    assert "TEMPLATE" not in ollama_modelfile("m.gguf", tokenizer)  # no template given: the raw prompt


@pytest.mark.parametrize(
    "case",
    ["classifier", "adapter", "quant", "inside", "suffix"],
)
def test_bad_input_is_one_line_and_writes_nothing(case, tmp_path, llama_folder):
    folder = llama_folder
    out, quant = tmp_path / "out" / "m.gguf", "f16"
    if case == "classifier":
        folder = tmp_path / "classifier"
        shutil.copytree(llama_folder, folder)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForSequenceClassification"]}))
    elif case == "adapter":  # an unmerged LoRA adapter folder
        folder = tmp_path / "adapter"
        folder.mkdir()
        (folder / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    elif case == "quant":
        quant = "q3_k_xl"
    elif case == "inside":
        folder = tmp_path / "copy"
        shutil.copytree(llama_folder, folder)
        out = folder / "m.gguf"
    else:
        out = tmp_path / "out" / "m.bin"
    before = snapshot(tmp_path)
    (tmp_path / "params.yaml").write_text("{}\n")
    args = ["export", "--format", "gguf", "--checkpoint", str(folder), "--out", str(out), "--quant", quant]
    r = run_cli(args, tmp_path, cli_env(GPTFORGE_PREFECT="0"))
    assert r.returncode == 2, r.stderr[-2000:]
    line = last_error_line(r.stderr)
    said = {
        "classifier": "classifiers",
        "adapter": "LoRA adapter",
        "quant": "q3_k_xl",
        "inside": "inside the checkpoint",
        "suffix": ".gguf",
    }
    assert said[case] in line
    (tmp_path / "params.yaml").unlink()
    assert snapshot(tmp_path) == before


def test_smollm2_out_again_answers_as_it_came_in(smollm2_folder, tmp_path):
    """The GGUF in -> folder -> GGUF out round trip: f16 the same greedy 32-token answers as the
    folder, q8_0 the same on at least 2 of 3 and a held-out perplexity within 2%."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    f16 = export_gguf(smollm2_folder, tmp_path / "f16" / "smollm2.gguf", "f16")
    modelfile = (f16.parent / "Modelfile").read_text()
    assert "<|im_start|>" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile
    model, gguf_tok = _read_back(f16)
    assert gguf_tok.chat_template == tok.chat_template
    ids = tok(HELD_OUT, return_tensors="pt").input_ids
    want = _logits(source, ids)
    assert _relative_error(want, _logits(model, ids)) < 1e-2
    answers = [_greedy(m, tok, p) for m in (source, model) for p in PROMPTS]
    assert answers[:3] == answers[3:], answers
    del model

    q8 = export_gguf(smollm2_folder, tmp_path / "q8" / "smollm2.gguf", "q8_0")
    quantized, _ = _read_back(q8)
    same = sum(_greedy(quantized, tok, p) == a for p, a in zip(PROMPTS, answers[:3]))
    assert same >= 2, same
    ppl = [_perplexity(m, ids) for m in (source, quantized)]
    assert abs(ppl[1] / ppl[0] - 1) < 0.02, ppl
    print(f"SmolLM2 held-out perplexity: folder {ppl[0]:.3f}, q8_0 GGUF {ppl[1]:.3f}; same greedy answers {same}/3")


def _greedy(model, tok, prompt: str) -> list[int]:
    inputs = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=32, do_sample=False)[0].tolist()


def _perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return torch.exp(model(ids, labels=ids).loss).item()
