"""The `data` section of `params.yaml`: what each data stage reads (pretrain, classify, instruct,
preference: the source, its checksum, the splits) and how downloads are retried.

`gptforge.config.schema.Config` holds it; the fields are documented where they are declared.
"""

from __future__ import annotations

from typing import Optional

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


class PretrainData(Section):
    source: str = "hf://HuggingFaceFW/fineweb-edu"
    name: Optional[str] = "sample-10BT"  # hub dataset configuration
    split: str = "train"  # hub dataset split
    text_field: str = "text"
    sha256: Optional[str] = None  # for https:// sources
    max_tokens: int = Field(20_000_000, gt=0)
    shard_tokens: int = Field(10_000_000, gt=0)
    val_tokens: int = Field(1_000_000, ge=0)
    workers: int = Field(0, ge=0, description="tokenizer threads; 0 = one per CPU core")

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
