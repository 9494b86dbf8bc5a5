"""Prefect flows: one per DVC stage (`stages`, made per module: `prepare`, `pretrain`, ...), the
pipeline flow, --pool submission, Prefect API outages (`outage`), and the recorder that turns the
stages' journals into MLflow and Prefect records (`recorder`, `records_prefect`).

Importing this package imports nothing: the recorder starts without Prefect's import cost."""
