"""The offline quickstart: embedded samples, gzip-aware readers, the named configs, the
pipeline's choice of stages, and base models fetched into checkpoints/base."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from gptforge import samples
from gptforge.config.load import load_config, validate
from gptforge.errors import BadInput
from gptforge.pipeline.dvc import dvc_stages
from gptforge.pipeline.run import check_start_folders, default_targets

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def test_quickstart_config_is_params_yaml():
    assert (REPO / "configs" / "quickstart.yaml").read_bytes() == (REPO / "params.yaml").read_bytes()


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    header = path.read_text(encoding="utf-8").splitlines()[0]
    assert header.startswith("#"), "each config opens with a comment saying what it reproduces"
    # dvc.yaml tracks the folders fine-tuning starts from: each config names ones that a stage makes
    check_start_folders(cfg, REPO)


def test_expected_configs_are_shipped():
    names = {p.name for p in CONFIGS}
    assert {"quickstart.yaml", "gpt2-124m-fineweb.yaml", "gpt2-hub-finetune.yaml", "cpu-hub.yaml"} <= names


def test_build_nanogpt_numbers():
    c = load_config(REPO / "configs" / "gpt2-124m-fineweb.yaml")
    p = c.pretrain
    assert (c.model.n_layer, c.model.n_head, c.model.n_embd, c.model.block_size, c.model.vocab_size) == (
        12,
        12,
        768,
        1024,
        50304,
    )
    assert (p.batch_tokens, p.batch_size, p.nproc_per_node, p.max_steps, p.warmup_steps) == (524288, 64, 8, 19073, 715)
    assert (p.lr, p.min_lr, p.weight_decay, p.grad_clip, p.seed) == (6e-4, 6e-5, 0.1, 1.0, 1337)
    assert p.precision == "bf16" and p.compile is True and c.model.attention == "sdpa"
    assert p.hellaswag_interval == 250 and p.hellaswag.source.startswith("https://")
    assert c.data.pretrain.source == "hf://HuggingFaceFW/fineweb-edu" and c.data.pretrain.name == "sample-10BT"


def test_qwen_7b_config_is_full_fine_tuning_on_8_gpus_with_fsdp_and_the_plan_says_it_fits(capsys):
    from gptforge.cli import main

    path = REPO / "configs" / "qwen2.5-7b-fsdp.yaml"
    c = load_config(path)
    i = c.instruct
    assert c.base.models[Path(i.init_from).name] == "Qwen/Qwen2.5-7B-Instruct"
    assert (i.method, i.strategy, i.nproc_per_node, i.precision, c.world_size("instruct")) == (
        "full",
        "fsdp",
        8,
        "bf16",
        8,
    )
    assert main(["plan", "--params", str(path)]) == 0
    rows = {
        line.split()[0]: line.split()
        for line in capsys.readouterr().out.splitlines()
        if line.split()[:1] in (["ddp"], ["zero1"], ["fsdp"])
    }
    assert rows["fsdp"][-1] == "yes" and rows["ddp"][-1] == rows["zero1"][-1] == "no"


def test_llama_124m_config_is_the_gpt2_run_with_the_llama_arch_and_the_plan_counts_it(capsys):
    import torch

    from gptforge.cli import main
    from gptforge.modeling.gpt import GPT, GPTConfig

    gpt2, llama = (load_config(REPO / "configs" / f"{name}-124m-fineweb.yaml") for name in ("gpt2", "llama"))
    assert llama.pretrain == gpt2.pretrain and llama.data == gpt2.data  # same tokens, same budget
    m = llama.model
    assert (m.arch, m.n_layer, m.n_head, m.n_embd, m.n_kv_head, m.block_size) == ("llama", 12, 12, 768, 4, 1024)
    with torch.device("meta"):
        model = GPT(GPTConfig.from_model_config(m, 50257))
    assert model.config.bias is False and model.config.ffn_hidden == 2048 and model.config.tie_embeddings
    n = sum(p.numel() for p in model.parameters())
    assert main(["plan", "--params", str(REPO / "configs" / "llama-124m-fineweb.yaml")]) == 0
    out = capsys.readouterr().out
    assert f"gptforge GPT (llama, 12 layers, d=768, vocab 50304): {n / 1e6:.1f}M parameters" in out


def test_quickstart_reads_only_embedded_samples():
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    cfg = load_config(REPO / "params.yaml")
    folder = str(samples.FOLDER)
    for value in (
        cfg.tokenizer.path,
        cfg.data.pretrain.source,
        cfg.data.classify.source,
        cfg.data.instruct.source,
        cfg.evaluate.hellaswag.source,
        cfg.evaluate.mmlu.source,
    ):
        assert value.startswith(folder) and Path(value).exists()
    assert params["data"]["pretrain"]["source"].startswith("sample://")


def test_unknown_sample_is_one_line_bad_input():
    with pytest.raises(BadInput) as e:
        validate({"data": {"classify": {"source": "sample://nope.gz"}}})
    assert "no embedded sample 'nope.gz'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(BadInput):
        validate({"tokenizer": {"path": "sample://../../etc"}})


def test_embedded_samples_are_small_and_documented():
    total = sum(p.stat().st_size for p in samples.FOLDER.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert total < 6_000_000
    notice = (samples.FOLDER / "NOTICE").read_text(encoding="utf-8")
    for name in samples.available():
        if "/" not in name:
            assert name in notice, f"{name} has no NOTICE entry"


def test_embedded_mmlu_covers_all_subjects():
    from gptforge.evaluate.task_data import load_mmlu, mmlu_files

    files = mmlu_files(samples.resolve("sample://mmlu"))
    test, dev = load_mmlu(files["test"]), load_mmlu(files["dev"])
    assert len({d["subject"] for d in test}) == 57 and len({d["subject"] for d in dev}) == 57


def test_quickstart_context_holds_the_instruction_records():
    from gptforge.data.sources import read_records
    from gptforge.finetune.templates import render
    from gptforge.modeling.tokenizer import load_tokenizer

    cfg = load_config(REPO / "params.yaml")
    enc = load_tokenizer(cfg.tokenizer.path)
    records = read_records(cfg.data.instruct.source, param="data.instruct.source")
    assert len(records) == 1100
    fits = sum(
        len(enc.encode_ordinary("".join(render(r, cfg.instruct.template)))) + 1 <= cfg.model.block_size for r in records
    )
    assert fits / len(records) >= 0.9


# --------------------------------------------------------------------------------------------
# gzip: every reader takes the compressed file and reads what the plain one holds


def test_gzip_records_equal_plain(tmp_path):
    from gptforge.data.sources import read_records

    rows = [{"instruction": f"say {i}", "input": "", "output": str(i)} for i in range(5)]
    for name, text in (("a.jsonl", "".join(json.dumps(r) + "\n" for r in rows)), ("a.json", json.dumps(rows))):
        (tmp_path / name).write_text(text)
        (tmp_path / f"{name}.gz").write_bytes(gzip.compress(text.encode()))
        assert read_records(tmp_path / f"{name}.gz", param="p") == read_records(tmp_path / name, param="p") == rows


def test_damaged_gzip_is_bad_input(tmp_path):
    from gptforge.data.classify import read_sms
    from gptforge.data.sources import read_records

    bad = tmp_path / "a.jsonl.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(BadInput, match="cannot read it"):
        read_records(bad, param="p")
    sms = tmp_path / "SMSSpamCollection.gz"
    sms.write_bytes(b"\x1f\x8b broken")
    with pytest.raises(BadInput, match="cannot read it"):
        read_sms(sms)


def test_gzip_sms_and_corpus_read_like_plain(tmp_path):
    from gptforge.data.classify import read_sms
    from gptforge.data.pretrain import find_corpus, iter_documents

    lines = "ham\thello there\nspam\tWIN a prize now\nham\tsee you\n"
    (tmp_path / "SMSSpamCollection").write_text(lines)
    (tmp_path / "SMSSpamCollection.gz").write_bytes(gzip.compress(lines.encode()))
    assert read_sms(tmp_path / "SMSSpamCollection.gz").examples == read_sms(tmp_path / "SMSSpamCollection").examples
    text = "One document of text. " * 50
    (tmp_path / "c.txt").write_text(text)
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(text.encode()))

    def read(name):
        corpus = find_corpus(str(tmp_path / name), name=None, split="train", text_field="text", param="p")
        return ["".join(doc) for doc in iter_documents(corpus)]

    assert read("c.txt.gz") == read("c.txt") == [text]


# --------------------------------------------------------------------------------------------
# The pipeline's stages follow init_from


def test_quickstart_runs_every_stage_and_hub_config_skips_pretraining():
    known = dvc_stages(REPO)
    assert default_targets(load_config(REPO / "params.yaml"), known) == []  # [] = dvc repro of everything
    targets = default_targets(load_config(REPO / "configs" / "gpt2-hub-finetune.yaml"), known)
    assert "pretrain" not in targets and "prepare_pretrain" not in targets
    assert {"finetune_classify", "finetune_instruct", "evaluate"} <= set(targets)
    assert not {"synthesize", "index", "evaluate_qa", "prepare_base"} & set(targets)  # no documents there
    # the SmolLM2 config: its document set's groups by name, and its base folder as their dependency
    targets = default_targets(load_config(REPO / "configs" / "smollm2-135m-cpu.yaml"), known)
    assert {"synthesize", "index", "evaluate_qa", "finetune_rl", "register"} <= set(targets)
    assert not {"pretrain", "prepare_pretrain", "prepare_base", "finetune_instruct_variant"} & set(targets)


def test_hub_name_as_dvc_input_is_refused_with_the_fix(tmp_path):
    cfg = load_config(REPO / "params.yaml", ["classify.init_from=gpt2"])
    with pytest.raises(BadInput, match=r"add `NAME: gpt2` under base.models and set classify.init_from"):
        check_start_folders(cfg, tmp_path)
    cfg = load_config(REPO / "params.yaml", ["instruct.init_from=checkpoints/base/x"])
    with pytest.raises(BadInput, match="fetched by no stage"):
        check_start_folders(cfg, tmp_path)


def test_prepare_base_fetches_a_local_hf_folder(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from gptforge.data.base_models import prepare_base
    from gptforge.modeling.hf_convert import load_pretrained

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=300, n_positions=32, n_embd=32, n_layer=1, n_head=2)).eval()
    hf.save_pretrained(tmp_path / "src")
    cfg = load_config(None, [f"base.models={{tiny: {tmp_path / 'src'}}}", "base.only=tiny", "tracking.enabled=false"])
    metrics = prepare_base(cfg, out_root=tmp_path / "checkpoints/base", metrics_dir=tmp_path / "metrics")
    assert metrics["tiny.parameters"] == sum(p.numel() for p in hf.parameters())
    model, source = load_pretrained(str(tmp_path / "checkpoints/base/tiny"), param="classify.init_from")
    idx = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        ours = model.eval()(idx)[0][..., :300]
        theirs = hf(idx).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert json.loads((tmp_path / "metrics/tiny.json").read_text())["parameters"] > 0
    shutil.rmtree(tmp_path / "src")
    with pytest.raises(BadInput, match="no entry 'other'"):
        prepare_base(load_config(None, ["base.models={tiny: x}", "base.only=other"]), out_root=tmp_path / "o")
