"""The `data` section of `params.yaml`: what each data stage reads (pretrain, classify, instruct,
preference: the source, its checksum, the splits) and how downloads are retried.

`gptforge.config.schema.Config` holds it; the fields are documented where they are declared.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator

from gptforge.config.checks import _check_instruct_source, _check_source, _check_splits, _resolve_sample
from gptforge.config.section import Section

SMS_SPAM_URL = "https://archive.ics.uci.edu/static/public/228/sms+spam+collection.zip"
ALPACA_URL = "https://raw.githubusercontent.com/tatsu-lab/stanford_alpaca/main/alpaca_data.json"
# LLMs-from-scratch ch. 7's preference pairs (the Alpaca-style records with chosen/rejected answers)
PREFERENCE_URL = (
    "https://raw.githubusercontent.com/rasbt/LLMs-from-scratch/main/ch07/04_preference-tuning-with-dpo/"
    "instruction-data-with-preference.json"
)


class DownloadConfig(Section):
    retries: int = Field(3, ge=0, description="extra attempts after the first")
    backoff: float = Field(2.0, ge=0, description="seconds before the first retry; doubles each time")
    timeout: float = Field(30.0, gt=0, description="socket timeout in seconds")


class PretrainCluster(Section):
    """How prepare_pretrain's datatrove tasks are cut and where they run (docs/data.md)."""

    tasks: int = Field(1, gt=0, description="datatrove tasks; the input files are dealt out among them")
    workers: int = Field(1, gt=0, description="local: tasks run at once (each uses data.pretrain.workers threads)")
    # the tasks' logs, completion marks and token parts (a folder every node sees, on a cluster);
    # null: .gptforge/cache/prepare_pretrain in the project
    logging_dir: Optional[str] = None
    partition: Optional[str] = None  # slurm: the partition (needed)
    time: str = "04:00:00"  # slurm: each task's time limit
    job_name: str = "gptforge-prepare-pretrain"
    cpus_per_task: int = Field(2, gt=0, description="slurm, ray")
    mem_per_cpu_gb: int = Field(2, gt=0, description="slurm, ray")
    ray_address: Optional[str] = None  # ray: the cluster's address; null: RAY_ADDRESS or a local Ray
    poll_seconds: float = Field(5.0, gt=0, description="slurm: how often the stage looks at its job")


class PretrainFilters(Section):
    min_chars: int = Field(0, ge=0, description="documents with fewer characters are dropped; 0 = off")
    # near-duplicate documents dropped (datatrove's MinHash: 5-gram shingles, 14 buckets of 8
    # hashes, each cluster keeping one) before tokenizing
    minhash: bool = False


class PretrainData(Section):
    source: str = "hf://HuggingFaceFW/fineweb-edu"
    name: Optional[str] = "sample-10BT"  # hub dataset configuration
    split: str = "train"  # hub dataset split
    text_field: str = "text"
    sha256: Optional[str] = None  # for https:// sources
    max_tokens: int = Field(20_000_000, gt=0)
    shard_tokens: int = Field(10_000_000, gt=0)
    val_tokens: int = Field(1_000_000, ge=0)
    workers: int = Field(0, ge=0, description="tokenizer threads of each task; 0 = one per CPU core")
    # where the tokenizing tasks run (datatrove executors): local | slurm | ray
    executor: Literal["local", "slurm", "ray"] = "local"
    cluster: PretrainCluster = PretrainCluster()
    filters: PretrainFilters = PretrainFilters()

    _sample = field_validator("source", mode="before")(_resolve_sample)
    _source = field_validator("source")(_check_source)


class ClassifyData(Section):
    source: str = SMS_SPAM_URL
    sha256: Optional[str] = None
    splits: list[float] = [0.7, 0.1, 0.2]
    max_bad_fraction: float = Field(0.01, ge=0, le=1)
    balance: bool = True  # undersample the majority class
    seed: int = 123

    _sample = field_validator("source", mode="before")(_resolve_sample)
    _source = field_validator("source")(_check_source)
    _splits = field_validator("splits")(_check_splits)


class InstructData(Section):
    source: str = ALPACA_URL  # or synthetic://NAME: the pairs stage synthesize@NAME kept
    sha256: Optional[str] = None
    split: str = "train"  # for hf:// sources
    splits: list[float] = [0.85, 0.05, 0.10]
    seed: int = 123

    _sample = field_validator("source", mode="before")(_resolve_sample)
    _source = field_validator("source")(_check_instruct_source)
    _splits = field_validator("splits")(_check_splits)


class PreferenceData(Section):
    # LLMs-from-scratch ch. 7's records (instruction, input, output, chosen, rejected) or Hugging
    # Face's (prompt, chosen, rejected; chosen/rejected may be message lists), e.g. UltraFeedback.
    source: str = PREFERENCE_URL
    sha256: Optional[str] = None
    split: str = "train_prefs"  # for hf:// sources
    splits: list[float] = [0.85, 0.10, 0.05]
    # records without chosen/rejected, with identical ones, or of another shape are dropped and
    # counted; more than this fraction of them fails the stage
    max_bad_fraction: float = Field(0.01, ge=0, le=1)
    seed: int = 123

    _sample = field_validator("source", mode="before")(_resolve_sample)
    _source = field_validator("source")(_check_source)
    _splits = field_validator("splits")(_check_splits)


class DataConfig(Section):
    download: DownloadConfig = DownloadConfig()
    pretrain: PretrainData = PretrainData()
    classify: ClassifyData = ClassifyData()
    instruct: InstructData = InstructData()
    preference: PreferenceData = PreferenceData()
