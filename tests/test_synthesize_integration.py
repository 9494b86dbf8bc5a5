"""The synthesize stage with the rest of gptforge: with no endpoint, the chunks alone and the
retrieval index built from them (training on them refused in one line); `dvc repro` from the
documents through `prepare_instruct` into `finetune_instruct` and `index@NAME`, every reply
cached; a real `gptforge serve` on a tiny model as the endpoint. The documents and the stage's
runner are tests/test_synthesize.py's."""

from __future__ import annotations

import json
import re
import types

import pytest
from chat_endpoint import ChatEndpoint
from cli_support import cli_env, set_params
from test_synthesize import DOC, _cfg, _jsonl, _pairs, _run

from gptforge.config.load import load_config
from gptforge.errors import StageFailed

# ---------------------------------------------------------------------------------------------
# No endpoint: the chunks alone, and the retrieval index built from them


def test_no_endpoint_writes_the_chunks_alone_and_the_index_is_built_from_them(tmp_path):
    """synthesize.endpoint null (offline: no teacher): the set's folder holds chunks.jsonl and no
    qa.jsonl, the report and metrics say no pair was asked, index@NAME builds from the chunks,
    and training on synthetic://NAME is refused in one line instead of finding no pairs."""
    from gptforge.data.instruct import synthetic_records
    from gptforge.errors import BadInput
    from gptforge.rag.index import Index
    from gptforge.rag.stage import index
    from gptforge.synthesize.chunks import read_chunks

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "rivers.md").write_text(DOC, encoding="utf-8")
    cfg = load_config(
        None,
        [
            "tokenizer.path=sample://gpt2_tokenizer",
            f"synthesize.documents={{rivers: {docs}}}",
            "synthesize.chunk_tokens=70",
            "synthesize.chunk_overlap=0",
            "tracking.enabled=false",
        ],
    )
    assert cfg.synthesize.endpoint.url is None and cfg.synthesize.endpoint.model is None
    metrics = _run(tmp_path, cfg)
    out = tmp_path / "data/synthetic/rivers"
    assert sorted(p.name for p in out.iterdir()) == ["chunks.jsonl"]
    chunks = read_chunks(out / "chunks.jsonl")
    assert [c.headings[-1] for c in chunks] == ["Rhine", "Danube", "Glaciers", "Salmon", "Beavers", "长江"]
    assert metrics == {"documents": 1, "chunks": 6, "requests": 0, "pairs_asked": 0, "kept": 0}
    assert json.loads((tmp_path / "metrics/synthesize_rivers.json").read_text()) == metrics
    assert "**Chunks only: no pairs.**" in (tmp_path / "reports/synthesize_rivers.md").read_text()
    assert not (tmp_path / "cache").exists()  # nothing was asked

    got = index(
        cfg,
        synthetic_root=tmp_path / "data/synthetic",
        out_root=tmp_path / "data/index",
        instruct_dir=tmp_path / "data/instruct",
        metrics_dir=tmp_path / "metrics",
    )
    assert got["chunks"] == 6 and got["questions"] == 0 and "recall_at_1" not in got
    idx = Index.load(tmp_path / "data/index/rivers", name="rivers")
    assert idx.search("Where do salmon spawn?", 1)[0].chunk.headings[-1] == "Salmon"

    with pytest.raises(BadInput, match=re.escape("synthetic://rivers: ") + ".*holds chunks only, no pairs") as e:
        synthetic_records("rivers", tmp_path / "data/synthetic")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------
# Into training: dvc repro synthesize -> prepare_instruct -> finetune_instruct


class ManualEndpoint(ChatEndpoint):
    """Three grounded pairs per chunk: each answer a sentence of the chunk, each question naming
    the chunk's place in the manual (so none repeats another)."""

    def answer(self, body: dict) -> str:
        text = body["messages"][-1]["content"]
        where = re.search(r"Document: (.*)\n(?:Section: (.*)\n)?", text)
        chunk = text.split('Text:\n"""\n', 1)[1].rsplit('\n"""', 1)[0]
        sentences = [
            s.strip()
            for s in re.split(r"(?<=[.!?])\s+", " ".join(chunk.split()))
            if len(s.split()) >= 6 and "`" not in s and "|" not in s
        ]
        topic = where.group(2) or where.group(1)
        with self.lock:
            n = len(self.requests)
        return _pairs(
            *[
                (f"What does the gptforge manual say about {topic}, point {n}.{k}?", s)
                for k, s in enumerate(sentences[:3])
            ]
        )


@pytest.mark.slow
def test_dvc_repro_synthesizes_then_prepares_and_fine_tunes_on_the_kept_pairs(
    repo_copy, tmp_path, prefect_api, no_proxy
):
    import shutil

    from cli_support import REPO
    from hf_models import make_tiny_causal_lm
    from test_dvc import dvc

    llama = make_tiny_causal_lm(tmp_path / "llama", "llama")
    (repo_copy / "manual").mkdir()
    for page in ("reliability.md", "serving.md"):  # questions about gptforge from its own manual
        shutil.copy(REPO / "docs" / page, repo_copy / "manual" / page)
    server = ManualEndpoint()
    try:
        set_params(
            repo_copy,
            **{
                "synthesize.documents": {"manual": "manual"},
                "synthesize.endpoint.url": server.url,
                "synthesize.endpoint.model": "scripted",
                "synthesize.concurrency": 4,
                "data.instruct.source": "synthetic://manual",
                "data.instruct.splits": [0.8, 0.1, 0.1],
                "base.models": {"tiny": str(llama)},
                "instruct.init_from": "checkpoints/base/tiny",
                "instruct.template": "chat",
                "instruct.method": "lora",
                "instruct.mask_prompt": True,
                "instruct.epochs": 1,
                "instruct.batch_size": 8,
                "instruct.eval_interval": 50,
                "instruct.eval_batches": 1,
                "instruct.n_responses": None,
                "instruct.max_new_tokens": 4,
                "instruct.max_length": 256,
                "tracking.enabled": False,
            },
        )
        env = cli_env(PREFECT_API_URL=prefect_api)
        first = dvc(repo_copy, "repro", "finetune_instruct", env=env)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
        ran = re.findall(r"Running stage '([\w@.-]+)'", first.stdout)
        assert ran.index("synthesize@manual") < ran.index("prepare_instruct") < ran.index("finetune_instruct"), ran
        kept = _jsonl(repo_copy / "data/synthetic/manual/qa.jsonl")
        requests = len(server.requests)
        synth = json.loads((repo_copy / "metrics/synthesize_manual.json").read_text())
        assert synth["kept"] == len(kept) >= 20 and synth["requests"] == requests

        splits = {name: _jsonl(repo_copy / f"data/instruct/{name}.jsonl") for name in ("train", "val", "test")}
        assert sum(map(len, splits.values())) == len(kept) and all(splits.values())
        by_question = {r["instruction"]: r for r in kept}
        for record in splits["test"]:  # the provenance travels into the split files
            assert record == {**by_question[record["instruction"]]}
        # every test question answered (n_responses: null) and scored
        responses = _jsonl(repo_copy / "reports/instruct_responses.jsonl")
        assert [r["instruction"] for r in responses] == [r["instruction"] for r in splits["test"]]
        metrics = json.loads((repo_copy / "metrics/instruct.json").read_text())
        assert metrics["n_scored"] == len(splits["test"]) and {"exact_match", "token_f1", "rouge_l"} <= set(metrics)

        again = dvc(repo_copy, "repro", "finetune_instruct", env=env)
        assert again.returncode == 0 and "Running stage" not in again.stdout, again.stdout[-2000:]
        forced = dvc(repo_copy, "repro", "--force", "--single-item", "synthesize@manual", env=env)
        assert forced.returncode == 0, forced.stdout[-3000:] + forced.stderr[-3000:]
        assert len(server.requests) == requests  # every reply came from the cache
        assert _jsonl(repo_copy / "data/synthetic/manual/qa.jsonl") == kept

        # the retrieval index of the same chunks (stage index@manual), scored on the kept questions
        # and on the held-out split alone (instruct reads these pairs)
        indexed = dvc(repo_copy, "repro", "index@manual", env=env)
        assert indexed.returncode == 0, indexed.stdout[-3000:] + indexed.stderr[-3000:]
        quality = json.loads((repo_copy / "metrics/index_manual.json").read_text())
        assert quality["questions"] == len(kept) and quality["heldout_questions"] == len(splits["test"])
        assert 0 < quality["recall_at_1"] <= quality["recall_at_5"] <= quality["recall_at_10"] <= 1
        assert (repo_copy / "data/index/manual/index.json").is_file()
    finally:
        server.close()


# ---------------------------------------------------------------------------------------------
# Against a real `gptforge serve` on a tiny model


@pytest.mark.slow
def test_against_gptforge_serve_on_a_tiny_model(tmp_path, no_proxy, monkeypatch):
    """The stage's requests go over HTTP to our own server (its key from GPTFORGE_SYNTH_API_KEY);
    the tiny model's replies are parsed or counted as unparseable, and the report is written,
    whatever its pairs are worth."""
    import urllib.request

    from serve_support import Server, tiny_gpt

    server = Server([f"tiny={tiny_gpt(tmp_path / 'tiny')}"], tmp_path, "--api-key", "sk-serve")
    try:
        monkeypatch.setenv("GPTFORGE_SYNTH_API_KEY", "sk-serve")
        cfg = _cfg(
            tmp_path,
            types.SimpleNamespace(url=f"{server.url}/v1"),
            **{"synthesize.endpoint.model": "tiny", "synthesize.max_tokens": 24, "synthesize.temperature": 0.0},
        )
        try:
            metrics = _run(tmp_path, cfg)
        except StageFailed as failed:  # the tiny model's pairs, if any, did not pass the filters
            assert "no pair kept" in str(failed)
            metrics = json.loads((tmp_path / "metrics/synthesize_rivers.json").read_text())
        with urllib.request.urlopen(f"{server.url}/metrics") as reply:
            served = sum(
                float(line.rsplit(" ", 1)[1])
                for line in reply.read().decode().splitlines()
                if line.startswith("gptforge_requests_total{") and "chat/completions" in line and 'status="200"' in line
            )
    finally:
        server.stop()
    # one request per chunk, and one more for each chunk whose first reply did not parse
    assert 6 <= metrics["requests"] == served <= 12
    retried = metrics["requests"] - 6
    assert metrics["unparseable"] <= retried
    assert metrics["completion_tokens"] > 0 and metrics["endpoint_tokens_per_sec"] > 0
    report = (tmp_path / "reports/synthesize_rivers.md").read_text(encoding="utf-8")
    assert f"| requests | {metrics['requests']} |" in report and f"| unparseable | {metrics['unparseable']} |" in report
