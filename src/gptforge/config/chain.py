"""Where each model the pipeline makes began: the `init_from` chain of its folder.

Every fine-tuning stage names the folder it starts from (`classify.init_from`,
`instruct.init_from`, an instruct variant's `init_from`, `preference.init_from`,
`reward.init_from`, `rl.init_from`); following those back from a made folder ends at one no
stage of the chain made: checkpoints/pretrain/... (the GPT pretrained here), checkpoints/base/NAME
(a model of `base.models`, fetched by prepare_base@NAME) or a hub name. The closing summary groups
its lines by that end (`family`); the registry tags each version with the whole chain
(`lineage`). Config only: no model is loaded, no folder need exist.
"""

from __future__ import annotations

from pathlib import Path

from gptforge.config.schema import Config, variant_paths

# The folder of each model a stage makes (registry.names' keys)
MODEL_FOLDERS = {
    "pretrain": "checkpoints/pretrain/final",
    "classify": "checkpoints/classify/final",
    "instruct": "checkpoints/instruct/final",
    "preference": "checkpoints/preference/final",
    "reward": "checkpoints/reward/final",
    "rl": "checkpoints/rl/final",
}
PRETRAINED = "checkpoints/pretrain"


def _norm(folder: str) -> str:
    return Path(folder).as_posix().rstrip("/")


def starts(cfg: Config) -> dict[str, str]:
    """Each folder a fine-tuning stage makes -> the folder it starts from."""
    out = {
        MODEL_FOLDERS["classify"]: cfg.classify.init_from,
        MODEL_FOLDERS["instruct"]: cfg.instruct.init_from,
        MODEL_FOLDERS["preference"]: cfg.preference.init_from,
        MODEL_FOLDERS["reward"]: cfg.reward.init_from,
        MODEL_FOLDERS["rl"]: cfg.rl.init_from,
    }
    for name in cfg.instruct_variants.models:
        out[variant_paths(name)["out_dir"] + "/final"] = cfg.instruct_variant(name).init_from
    return {_norm(k): _norm(v) for k, v in out.items()}


def chain(folder: str, cfg: Config) -> list[str]:
    """`folder` and each folder it started from, oldest first; a base model's entry ends with
    its source (`base.models.NAME`)."""
    links, seen, here = starts(cfg), [], _norm(folder)
    while here not in seen:
        seen.append(here)
        if here not in links:
            break
        here = links[here]
    name = base_name(seen[-1], cfg)
    if name is not None:
        seen.append(cfg.base.models[name])
    return seen[::-1]


def base_name(folder: str, cfg: Config) -> str | None:
    """NAME when `folder` is checkpoints/base/NAME of an entry of base.models, else None."""
    parts = Path(folder).parts
    return (
        parts[2] if parts[:2] == ("checkpoints", "base") and len(parts) == 3 and parts[2] in cfg.base.models else None
    )


def family(folder: str, cfg: Config) -> str:
    """Where `folder`'s weights began: checkpoints/pretrain for the GPT pretrained here, else the
    first folder of its chain (checkpoints/base/NAME, a hub name, a folder of one's own)."""
    links = chain(folder, cfg)
    first = next((f for f in links if "://" not in f), links[0])
    return PRETRAINED if Path(first).parts[:2] == ("checkpoints", "pretrain") else first


def family_title(root: str, cfg: Config) -> str:
    """A family's name in the closing summary."""
    if root == PRETRAINED:
        return "gptforge's GPT, pretrained here from scratch"
    name = base_name(root, cfg)
    return root if name is None else f"{name} ({cfg.base.models[name]})"
