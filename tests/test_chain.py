"""gptforge.config.chain: where each model the pipeline makes began, followed through the
`init_from` keys of the quickstart and of a named config that starts from hub weights."""

from __future__ import annotations

from pathlib import Path

from gptforge.config.chain import PRETRAINED, chain, family, family_title
from gptforge.config.load import load_config

REPO = Path(__file__).resolve().parents[1]


def test_the_quickstart_chains_smollm2_through_its_sft_and_the_tiny_gpt_through_pretraining():
    cfg = load_config(REPO / "params.yaml")
    assert chain("checkpoints/rl/final", cfg) == [
        "packaged://smollm2-135m-instruct",
        "checkpoints/base/smollm2",
        "checkpoints/instruct_smollm2/final",
        "checkpoints/rl/final",
    ]
    assert chain("checkpoints/preference/final", cfg)[-2:] == [
        "checkpoints/instruct_smollm2/final",
        "checkpoints/preference/final",
    ]
    assert chain("checkpoints/instruct/final", cfg) == ["checkpoints/pretrain/final", "checkpoints/instruct/final"]
    assert family("checkpoints/classify/final", cfg) == PRETRAINED
    assert family("checkpoints/reward/final/", cfg) == "checkpoints/base/smollm2"
    assert family_title("checkpoints/base/smollm2", cfg) == "smollm2 (packaged://smollm2-135m-instruct)"
    assert family_title(PRETRAINED, cfg) == "gptforge's GPT, pretrained here from scratch"


def test_rl_after_dpo_and_a_hub_name_and_a_loop():
    cfg = load_config(
        REPO / "params.yaml",
        [
            "rl.init_from=checkpoints/preference/final",
            "classify.init_from=gpt2",
            "instruct.init_from=checkpoints/instruct/final",
        ],
    )
    assert chain("checkpoints/rl/final", cfg)[-3:] == [
        "checkpoints/instruct_smollm2/final",
        "checkpoints/preference/final",
        "checkpoints/rl/final",
    ]
    assert chain("checkpoints/classify/final", cfg) == ["gpt2", "checkpoints/classify/final"]
    assert family("checkpoints/classify/final", cfg) == "gpt2" == family_title("gpt2", cfg)
    # a folder that starts from itself ends the walk instead of looping
    assert chain("checkpoints/instruct/final", cfg) == ["checkpoints/instruct/final"]
