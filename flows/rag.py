"""The retrieval stages as Prefect flows (deployment entry points): the index of a document set,
and its held-out questions answered without and with retrieval."""

from flows.stages import stage_flow

index = stage_flow("index")
evaluate_qa = stage_flow("evaluate_qa")
