"""In-loop HellaSwag (build-nanogpt completion style) against an independent computation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from gptforge.errors import BadInput
from gptforge.modeling.tokenizer import load_tokenizer
from gptforge.training import hellaswag as hs

EXAMPLES = [
    {
        "ind": 4,
        "activity_label": "Roof shingle removal",
        "ctx": "A man is sitting on a roof. he",
        "endings": [
            "is using wrap to wrap a pair of skis.",
            "is ripping level tiles off.",
            "is holding a rubik's cube.",
            "starts pulling up roofing on a roof.",
        ],
        "label": 3,
    },
    {
        "ctx": "The cat sat on the mat and then",
        "endings": [
            "it slept.",
            "the dog ran in the garden and barked at the birds for an hour.",
            "and",
            "they ate the whole cake, one slice at a time.",
        ],
        "label": 0,
    },
    {
        "ctx": "In the evening, the children went outside to play in the park near their home, and",
        "endings": [
            "the sun set.",
            "they played on the swings until dark.",
            "it rained",
            "their parents called them in for dinner",
        ],
        "label": "1",
    },
    {
        "ctx": "Is there anything more to say?",
        "endings": ["No.", "Yes, there is.", "", "Maybe, but not now."],
        "label": 2,
    },
]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def examples_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "hellaswag_val.jsonl", EXAMPLES)


@pytest.fixture(scope="module")
def enc(small_tokenizer):
    return load_tokenizer(str(small_tokenizer))


# --------------------------------------------------------------------------------------------
# Tiny models: any callable idx -> (logits, _). Columns >= n_vocab are -inf, like the GPT's.


class Bigram(nn.Module):
    """Logits at t depend on token t only: a random table, padded with -inf columns."""

    def __init__(self, n_vocab: int, padded: int, seed: int = 0, block_size: int | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        table = torch.randn(n_vocab, padded, generator=g) * 2
        table[:, n_vocab:] = float("-inf")
        self.table = nn.Parameter(table)
        self.block_size = block_size
        self.modes_seen: list[bool] = []

    def forward(self, idx, targets=None):
        self.modes_seen.append(self.training)
        if self.block_size is not None:
            assert idx.size(1) <= self.block_size, f"{idx.size(1)} > block_size {self.block_size}"
        return self.table[idx], None


class CausalMean(nn.Module):
    """Logits at t depend on tokens 0..t (a running mean of embeddings), so context matters."""

    def __init__(self, n_vocab: int, padded: int, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.n_vocab = n_vocab
        self.emb = nn.Embedding(n_vocab, 16)
        self.head = nn.Linear(16, padded)
        self.drop = nn.Dropout(0.5)  # would make scores random if evaluate left train mode on

    def forward(self, idx, targets=None):
        x = self.emb(idx).cumsum(dim=1) / torch.arange(1, idx.size(1) + 1).view(1, -1, 1)
        logits = self.head(self.drop(x))
        logits[..., self.n_vocab :] = float("-inf")
        return logits, None


def reference_losses(model, enc, example, drop_ctx: int = 0) -> list[tuple[float, float]]:
    """(sum, mean) loss per ending: one unpadded row at a time, log_softmax in float64."""
    ctx = enc.encode_ordinary(example["ctx"])[drop_ctx:]
    out = []
    for ending in example["endings"]:
        end = enc.encode_ordinary(" " + ending)
        seq = torch.tensor([ctx + end])
        with torch.no_grad():
            logits = model(seq)[0][0].double()
        logp = torch.log_softmax(logits, dim=-1)
        nll = [-logp[len(ctx) + j - 1, tok].item() for j, tok in enumerate(end)]
        out.append((sum(nll), sum(nll) / len(nll)))
    return out


def reference_evaluate(model, enc, examples) -> dict:
    correct = correct_norm = 0
    for ex in examples:
        losses = reference_losses(model, enc, ex)
        label = int(ex["label"])
        correct += min(range(4), key=lambda i: losses[i][0]) == label
        correct_norm += min(range(4), key=lambda i: losses[i][1]) == label
    n = len(examples)
    return {
        "acc": correct / n,
        "acc_norm": correct_norm / n,
        "n": n,
        "correct": correct,
        "correct_norm": correct_norm,
        "skipped": 0,
    }


# --------------------------------------------------------------------------------------------
# Loading


def test_load_examples_reads_and_normalises(examples_file):
    got = hs.load_examples(examples_file)
    assert len(got) == 4
    assert got[0] == {"ctx": EXAMPLES[0]["ctx"], "endings": EXAMPLES[0]["endings"], "label": 3}
    assert got[2]["label"] == 1  # Hugging Face's copy stores labels as digit strings
    assert len(hs.load_examples(examples_file, limit=2)) == 2


def test_limit_stops_before_a_bad_line(tmp_path):
    path = write_jsonl(tmp_path / "h.jsonl", EXAMPLES[:2] + ["{not json"])
    assert len(hs.load_examples(path, limit=2)) == 2
    with pytest.raises(BadInput, match=":3:"):
        hs.load_examples(path)


def test_blank_lines_are_skipped(tmp_path):
    path = write_jsonl(tmp_path / "h.jsonl", [EXAMPLES[0], "", "  ", EXAMPLES[1]])
    assert len(hs.load_examples(path)) == 2


@pytest.mark.parametrize(
    "bad, why",
    [
        ("{oops", "bad JSON"),
        ("[1, 2]", "JSON object"),
        ({"endings": ["a", "b", "c", "d"], "label": 0}, "missing ctx"),
        ({"ctx": 3, "endings": ["a", "b", "c", "d"], "label": 0}, "ctx must be a string"),
        ({"ctx": "  ", "endings": ["a", "b", "c", "d"], "label": 0}, "ctx is empty"),
        ({"ctx": "x", "endings": "abcd", "label": 0}, "endings must be a list"),
        ({"ctx": "x", "endings": ["a", "b", 3, "d"], "label": 0}, "endings must be a list of strings"),
        ({"ctx": "x", "endings": ["a", "b", "c"], "label": 0}, "4 strings, got 3"),
        ({"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 4}, "0-3, got 4"),
        ({"ctx": "x", "endings": ["a", "b", "c", "d"], "label": -1}, "0-3, got -1"),
        ({"ctx": "x", "endings": ["a", "b", "c", "d"], "label": "two"}, "label must be an integer"),
        ({"ctx": "x", "endings": ["a", "b", "c", "d"], "label": 1.0}, "label must be an integer"),
        ({"ctx": "x", "endings": ["a", "b", "c", "d"], "label": True}, "label must be an integer"),
    ],
)
def test_bad_lines_name_file_line_and_key(tmp_path, bad, why):
    path = write_jsonl(tmp_path / "h.jsonl", [EXAMPLES[0], bad])
    with pytest.raises(BadInput) as e:
        hs.load_examples(path)
    msg = str(e.value)
    assert f"{path}:2:" in msg and why in msg and "pretrain.hellaswag.source" in msg
    assert "\n" not in msg


def test_missing_empty_and_undecodable_files(tmp_path):
    with pytest.raises(BadInput, match="not found.*nope.jsonl") as e:
        hs.load_examples(tmp_path / "nope.jsonl")
    assert "pretrain.hellaswag.source" in str(e.value)
    with pytest.raises(BadInput, match="no examples"):
        hs.load_examples(write_jsonl(tmp_path / "empty.jsonl", [""]))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"ctx": "caf\xe9"}\n')
    with pytest.raises(BadInput, match=":1: not UTF-8"):
        hs.load_examples(tmp_path / "latin1.jsonl")
    with pytest.raises(BadInput, match="evaluate.hellaswag.source"):
        hs.load_examples(tmp_path / "nope.jsonl", source_key="evaluate.hellaswag.source")


# --------------------------------------------------------------------------------------------
# Rendering and scoring


def test_render_layout(enc):
    ex = EXAMPLES[1]
    tokens, mask, label = hs.render(ex, enc)
    ctx = enc.encode_ordinary(ex["ctx"])
    ends = [enc.encode_ordinary(" " + e) for e in ex["endings"]]
    assert label == 0 and tokens.dtype == torch.long and mask.dtype == torch.long
    assert tokens.shape == mask.shape == (4, len(ctx) + max(map(len, ends)))
    for i, end in enumerate(ends):
        row = ctx + end
        assert tokens[i, : len(row)].tolist() == row
        assert tokens[i, len(row) :].eq(0).all() and mask[i, len(row) :].eq(0).all()
        assert mask[i, : len(ctx)].eq(0).all() and mask[i, len(ctx) : len(row)].eq(1).all()


def test_render_with_gpt2_puts_a_space_before_endings(gpt2_tokenizer_dir):
    enc = load_tokenizer(str(gpt2_tokenizer_dir))
    for ex in EXAMPLES:
        tokens, mask, _ = hs.render(ex, enc)
        ctx = enc.encode_ordinary(ex["ctx"])
        for i, ending in enumerate(ex["endings"]):
            end = enc.encode_ordinary(" " + ending)
            assert end != enc.encode_ordinary(ending)  # the space is part of the first token
            assert tokens[i][mask[i].bool()].tolist() == end
            assert enc.decode(tokens[i][mask[i].bool()].tolist()) == " " + ending
            assert int(mask[i].sum()) == len(end)
            assert tokens[i, : len(ctx)].tolist() == ctx
    # A known GPT-2 split: " roof" is one token, so the ending starts with it.
    tokens, mask, _ = hs.render({"ctx": "on the", "endings": ["roof", "a", "b", "c"], "label": 0}, enc)
    assert tokens[0][mask[0].bool()].tolist() == [9753]


@pytest.mark.parametrize("model_cls", [Bigram, CausalMean])
def test_score_matches_float64_reference(enc, model_cls):
    model = model_cls(enc.n_vocab, enc.n_vocab + 7).eval()
    for ex in EXAMPLES:
        tokens, mask, _ = hs.render(ex, enc)
        with torch.no_grad():
            sum_loss, avg_loss = hs.score(model, tokens, mask)
        ref = reference_losses(model, enc, ex)
        assert sum_loss.dtype == torch.float32 and sum_loss.shape == (4,)
        assert torch.isfinite(sum_loss).all()
        for i, (s, a) in enumerate(ref):
            assert sum_loss[i].item() == pytest.approx(s, rel=1e-6, abs=1e-6)
            assert avg_loss[i].item() == pytest.approx(a, rel=1e-6, abs=1e-6)


def test_score_rejects_last_position_only_logits(enc):
    tokens, mask, _ = hs.render(EXAMPLES[0], enc)
    with pytest.raises(ValueError, match="every position"):
        hs.score(lambda idx: (torch.zeros(idx.size(0), 1, enc.n_vocab), None), tokens, mask)


# --------------------------------------------------------------------------------------------
# Evaluation


@pytest.mark.parametrize("model_cls, seed", [(Bigram, 0), (Bigram, 1), (CausalMean, 2), (CausalMean, 3)])
def test_evaluate_matches_reference(enc, examples_file, model_cls, seed):
    examples = hs.load_examples(examples_file)
    model = model_cls(enc.n_vocab, enc.n_vocab + 3, seed=seed)
    model.train()
    got = hs.evaluate(model, examples, enc)
    assert model.training  # mode restored
    model.eval()
    assert got == reference_evaluate(model, enc, examples)
    # Every label in turn: checks each example's two predictions, not only the totals.
    totals = {"correct": 0, "correct_norm": 0}
    for label in range(4):
        relabelled = [dict(ex, label=label) for ex in examples]
        got = hs.evaluate(model, relabelled, enc)
        assert got == reference_evaluate(model, enc, relabelled)
        totals = {k: totals[k] + got[k] for k in totals}
    assert totals == {"correct": 4, "correct_norm": 4}


def test_evaluate_runs_the_model_in_eval_mode_without_grad(enc, examples_file):
    examples = hs.load_examples(examples_file)
    model = Bigram(enc.n_vocab, enc.n_vocab)
    grad_modes = []
    wrapped = lambda idx: (grad_modes.append(torch.is_grad_enabled()), model(idx))[1]  # noqa: E731
    model.train()
    hs.evaluate(model, examples, enc)
    assert model.modes_seen == [False] * 4 and model.training
    hs.evaluate(wrapped, examples, enc)  # a plain callable works too
    assert grad_modes == [False] * 4
    model.eval()
    hs.evaluate(model, examples, enc)
    assert not model.training


def test_evaluate_splits_examples_by_rank(enc, examples_file):
    examples = hs.load_examples(examples_file)
    model = CausalMean(enc.n_vocab, enc.n_vocab, seed=5)
    parts = [hs.evaluate(model, examples, enc, rank=r, world_size=3) for r in range(3)]
    assert [p["n"] for p in parts] == [2, 1, 1]
    full = hs.evaluate(model, examples, enc)
    assert sum(p["correct"] for p in parts) == full["correct"]
    assert sum(p["correct_norm"] for p in parts) == full["correct_norm"]


def test_left_truncation_keeps_endings_whole(enc):
    ex = EXAMPLES[2]  # the long context
    tokens, mask, _ = hs.render(ex, enc)
    ctx_len = len(enc.encode_ordinary(ex["ctx"]))
    drop = 5
    block = tokens.size(1) - drop
    t2, m2 = hs.fit_to_block(tokens, mask, block)
    assert t2.size(1) == block
    assert torch.equal(t2, tokens[:, drop:]) and torch.equal(m2.sum(1), mask.sum(1))
    for i, ending in enumerate(ex["endings"]):
        assert t2[i][m2[i].bool()].tolist() == enc.encode_ordinary(" " + ending)
    assert hs.fit_to_block(tokens, mask, tokens.size(1)) == (tokens, mask)
    assert hs.fit_to_block(tokens, mask, None) == (tokens, mask)

    model = CausalMean(enc.n_vocab, enc.n_vocab, seed=7).eval()
    sum_loss, avg_loss = hs.score(model, t2, m2)
    ref = reference_losses(model, enc, ex, drop_ctx=drop)
    assert sum_loss.tolist() == pytest.approx([s for s, _ in ref], rel=1e-6, abs=1e-6)
    assert avg_loss.tolist() == pytest.approx([a for _, a in ref], rel=1e-6, abs=1e-6)

    # One context token must remain before the endings; otherwise the example cannot be scored.
    longest_end = tokens.size(1) - ctx_len
    assert hs.fit_to_block(tokens, mask, longest_end + 1) is not None
    assert hs.fit_to_block(tokens, mask, longest_end) is None


def test_evaluate_truncates_to_the_model_block_size(enc, examples_file):
    examples = hs.load_examples(examples_file)
    widths = [hs.render(ex, enc)[0].size(1) for ex in examples]
    block = sorted(widths)[-2]  # the longest example must lose context; the others fit
    model = Bigram(enc.n_vocab, enc.n_vocab, block_size=block)
    got = hs.evaluate(model, examples, enc, block_size=block)
    assert got["n"] == 4 and got["skipped"] == 0
    # The bigram model only sees the previous token, so truncation does not change its scores.
    assert got == reference_evaluate(Bigram(enc.n_vocab, enc.n_vocab), enc, examples)

    # block_size None: taken from model.config.block_size when the model has one.
    model.config = type("Cfg", (), {"block_size": block})()
    assert hs.evaluate(model, examples, enc)["n"] == 4


def test_evaluate_skips_examples_whose_ending_cannot_fit(enc, examples_file, caplog):
    examples = hs.load_examples(examples_file)
    longest_end = max(len(enc.encode_ordinary(" " + e)) for e in examples[1]["endings"])
    model = Bigram(enc.n_vocab, enc.n_vocab, block_size=longest_end)
    with caplog.at_level("WARNING", logger="gptforge.training.hellaswag"):
        got = hs.evaluate(model, examples, enc, block_size=longest_end)
    assert got["skipped"] >= 1 and got["n"] + got["skipped"] == 4
    assert "skipped" in caplog.text


def test_evaluate_with_cpu_bf16_autocast_agrees_with_its_reference_and_with_fp32(enc, examples_file):
    examples = hs.load_examples(examples_file)
    model = CausalMean(enc.n_vocab, enc.n_vocab, seed=1).eval()
    head_dtypes = []
    model.head.register_forward_hook(lambda m, i, out: head_dtypes.append(out.dtype))
    got = hs.evaluate(model, examples, enc, autocast_dtype=torch.bfloat16)
    assert set(head_dtypes) == {torch.bfloat16}  # autocast really ran the head in bf16
    # The same scores one unpadded row at a time under the same autocast (log-softmax in float64).
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert got == reference_evaluate(model, enc, examples)
        bf16 = [reference_losses(model, enc, ex) for ex in examples]
    fp32 = [reference_losses(model, enc, ex) for ex in examples]
    # bf16 keeps 8 significant bits: the per-ending losses move, by little; wherever every
    # choice's margin exceeds twice that move, fp32 must choose the same endings.
    for k in (0, 1):  # the summed loss (acc), the mean loss (acc_norm)
        moved = max(abs(a[k] - b[k]) for ea, eb in zip(fp32, bf16) for a, b in zip(ea, eb))
        assert 0 < moved < 0.01, moved
        margin = min(sorted(loss[k] for loss in ex)[1] - sorted(loss[k] for loss in ex)[0] for ex in fp32)
        assert margin > 2 * moved, (k, margin, moved)
    assert got == hs.evaluate(model, examples, enc)


def test_evaluate_on_no_examples(enc):
    got = hs.evaluate(Bigram(enc.n_vocab, enc.n_vocab), [], enc)
    assert got == {"acc": 0.0, "acc_norm": 0.0, "n": 0, "correct": 0, "correct_norm": 0, "skipped": 0}


# --------------------------------------------------------------------------------------------
# Two processes, gloo: every rank gets the global counts.


def _dist_worker(rank: int, world_size: int, init_file: str, tok_path: str, data_path: str, out_dir: str):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        enc = load_tokenizer(tok_path)
        model = CausalMean(enc.n_vocab, enc.n_vocab + 3, seed=11)
        got = hs.evaluate(model, hs.load_examples(data_path), enc, rank=rank, world_size=world_size)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
# A bound against a hang only (a rank that never joins the all-reduce): two spawned interpreters
# import torch and gptforge, seconds when idle, far more on 2 loaded cores.
@pytest.mark.timeout(300)
def test_all_reduce_over_two_gloo_processes(tmp_path, small_tokenizer, examples_file):
    import torch.multiprocessing as mp

    rows = EXAMPLES + [dict(ex, label=(int(ex["label"]) + 1) % 4) for ex in EXAMPLES] + EXAMPLES[:1]
    data = write_jsonl(tmp_path / "h9.jsonl", rows)  # 9 examples: ranks hold 5 and 4
    mp.spawn(
        _dist_worker,
        args=(2, str(tmp_path / "init"), str(small_tokenizer), str(data), str(tmp_path)),
        nprocs=2,
        join=True,
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    enc = load_tokenizer(str(small_tokenizer))
    single = hs.evaluate(CausalMean(enc.n_vocab, enc.n_vocab + 3, seed=11), hs.load_examples(data), enc)
    assert results[0] == results[1] == single
    assert single["n"] == 9
