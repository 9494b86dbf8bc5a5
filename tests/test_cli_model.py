"""`gptforge generate` and `gptforge export` on a small saved model."""

from __future__ import annotations

import pytest
import torch
from cli_support import error_lines

from gptforge.cli import main
from gptforge.modeling.decoding import generate
from gptforge.modeling.gpt import GPT, GPTConfig
from gptforge.modeling.tokenizer import load_tokenizer
from gptforge.modeling.weights import save_model


@pytest.fixture
def checkpoint(tmp_path, small_tokenizer, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GPTFORGE_PREFECT", "0")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=320, n_vocab=281))
    save_model(model, tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


def test_generate_prints_the_greedy_continuation_and_its_speed(checkpoint, small_tokenizer, capsys):
    model, folder = checkpoint
    rc = main(
        [
            "generate",
            "the cat and",
            "--checkpoint",
            str(folder),
            "--temperature",
            "0",
            "--max-new-tokens",
            "12",
            "-S",
            f"tokenizer.path={small_tokenizer}",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0, err
    enc = load_tokenizer(str(small_tokenizer))
    ids = enc.encode_ordinary("the cat and")
    expected = generate(model, torch.tensor([ids]), 12, temperature=0, eot_id=enc.eot_token)[0, len(ids) :].tolist()
    assert out == enc.decode([t for t in expected if t != enc.eot_token]) + "\n"
    assert "tokens/s" in err and "Traceback" not in err


def test_generate_with_a_seed_is_reproducible(checkpoint, small_tokenizer, capsys):
    _, folder = checkpoint
    outs = []
    for _ in range(2):
        assert (
            main(
                [
                    "generate",
                    "the",
                    "--checkpoint",
                    str(folder),
                    "--seed",
                    "7",
                    "--max-new-tokens",
                    "20",
                    "-S",
                    f"tokenizer.path={small_tokenizer}",
                ]
            )
            == 0
        )
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["generate", "x", "--checkpoint", "nowhere"], "nowhere"),
        (["generate", "x", "--max-new-tokens", "0"], "--max-new-tokens must be > 0"),
        (["generate", "x", "--max-new-tokens", "many"], "invalid int value"),
        (["export", "--checkpoint", "nowhere", "--out", "hf"], "nowhere"),
        (["export", "--out", "hf"], "--checkpoint"),
    ],
)
def test_bad_model_commands(args, fragment, checkpoint, small_tokenizer, capsys):
    rc = main([*args, "-S", f"tokenizer.path={small_tokenizer}"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    [line] = error_lines(err)
    assert fragment in line


def test_generate_refuses_a_truncated_checkpoint(checkpoint, small_tokenizer, capsys):
    _, folder = checkpoint
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    rc = main(["generate", "x", "--checkpoint", str(folder), "-S", f"tokenizer.path={small_tokenizer}"])
    [line] = error_lines(capsys.readouterr().err)
    assert rc == 2 and "model.safetensors" in line


def test_export_cli_writes_a_transformers_folder(checkpoint, gpt2_tokenizer_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=50304, n_vocab=50257))
    save_model(model, tmp_path / "big")
    rc = main(
        [
            "export",
            "--checkpoint",
            str(tmp_path / "big"),
            "--out",
            str(tmp_path / "hf"),
            "-S",
            f"tokenizer.path={gpt2_tokenizer_dir}",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    idx = torch.tensor([[15496, 995, 11, 340]])
    with torch.no_grad():
        ours = model(idx)[0][..., :50257]
        theirs = hf(idx).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
