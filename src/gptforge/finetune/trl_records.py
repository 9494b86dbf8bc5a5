"""What the trl stages (DPO, the reward model, RL) record while trl trains: a TrainerCallback that
sends trl's logs to the MLflow run under the stage's names, keeps them for the plots and shows a
progress bar (trl's names -> ours: the DPO stage's `METRIC_NAMES` unless the stage gives its own);
and the plots' CSV files."""

from __future__ import annotations

import csv
import os
from typing import Sequence

from gptforge.io import atomic_file

METRIC_NAMES = {
    "loss": "loss",
    "rewards/chosen": "rewards_chosen",
    "rewards/rejected": "rewards_rejected",
    "rewards/accuracies": "reward_accuracy",
    "rewards/margins": "reward_margin",
    "logps/chosen": "logps_chosen",
    "logps/rejected": "logps_rejected",
}


def records_callback(
    run,
    total_steps: int,
    *,
    names: dict[str, str] = METRIC_NAMES,
    desc: str = "preference",
    shown: tuple[str, str] = ("margin", "train_reward_margin"),
    last_eval: bool = True,
):
    """A transformers TrainerCallback that sends trl's logs to the MLflow run under our names
    (`names`: trl's -> ours, as train_<ours>, and val_<ours> at evaluations), keeps them for the
    plots, and shows a progress bar (`desc`) with the loss and one more figure (`shown`: its
    label and metric). `last_eval` False cancels the Trainer's evaluation at the last step, for a
    stage that validates itself after training (train_reward, finetune_preference)."""
    from tqdm.auto import tqdm
    from transformers import TrainerCallback

    class Records(TrainerCallback):
        def __init__(self) -> None:
            self.train: list[dict] = []
            self.val: list[dict] = []
            self.bar = None

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:  # one bar under torchrun
                self.bar = tqdm(total=state.max_steps or total_steps, desc=desc, unit="step", leave=False)

        def on_step_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.n)
            if not last_eval and state.global_step >= state.max_steps:
                control.should_evaluate = False

        def on_train_end(self, args, state, control, **kwargs):
            if self.bar is not None:
                self.bar.close()
                self.bar = None

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            prefix = "val_" if "eval_loss" in logs else "train_" if "loss" in logs else None
            if prefix is None:  # the end-of-training summary (train_runtime, ...)
                return
            key = (lambda k: f"eval_{k}") if prefix == "val_" else (lambda k: k)
            row = {f"{prefix}{ours}": float(logs[key(theirs)]) for theirs, ours in names.items() if key(theirs) in logs}
            run.log_metrics(row, step=state.global_step)
            (self.val if prefix == "val_" else self.train).append({"step": state.global_step, **row})
            if self.bar is not None and prefix == "train_":
                self.bar.set_postfix(
                    {"loss": f"{row.get('train_loss', 0):.4f}", shown[0]: f"{row.get(shown[1], 0):.4f}"}, refresh=False
                )

    return Records()


def write_csv(path: str | os.PathLike, rows: Sequence[dict], fields: Sequence[str]) -> None:
    with atomic_file(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(fields))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in fields})
