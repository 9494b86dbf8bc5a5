"""A Hugging Face causal-LM folder (Llama, Qwen2: what finetune_instruct may write) downstream:
`gptforge generate` (plain and --chat), the evaluate stage (lm-eval's HFLM) and MLflow's
transformers flavor (`run.log_hf_model`).

The references are independent of the code under test: transformers' own greedy `generate` and
forward passes run here on the same folder, a ChatML prompt written out by hand, and HellaSwag
scores recomputed from the raw model's log-probabilities.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from cli_support import cli_env, error_lines, last_error_line, run_cli
from fixture_data import FakeRun
from hf_models import CHATML, make_tiny_causal_lm, make_tiny_encoder
from test_evaluate import HELLASWAG, check_samples_against_model, scores_from_samples, write_jsonl

PROMPT = "The quick brown fox"
SPEED = re.compile(r"^gptforge: (\d+) tokens in [0-9.]+ s \([0-9.]+ tokens/s, cpu\)$")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_tiny_causal_lm(tmp_path_factory.mktemp("hf") / "llama", "llama")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return make_tiny_causal_lm(tmp_path_factory.mktemp("hf") / "qwen2", "qwen2", seed=1)


def load(folder: Path):
    """The folder with transformers' Auto classes, nothing of gptforge in between."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(str(folder)).eval(), AutoTokenizer.from_pretrained(str(folder))


def hf_greedy(folder: Path, prompt_ids: list[int], n: int) -> list[int]:
    """transformers' greedy decoding with the folder's own settings: the new ids."""
    model, tok = load(folder)
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=n,
        do_sample=False,
        pad_token_id=tok.eos_token_id,
    )
    return out[0, len(prompt_ids) :].tolist()


def cli(args: list[str], cwd: Path):
    return run_cli(args, cwd=cwd, env=cli_env(GPTFORGE_PREFECT="0", HF_HUB_OFFLINE="1"), timeout=120)


# --------------------------------------------------------------------------------------------
# generate_hf, in-process


def test_generate_hf_greedy_is_the_argmax_of_each_forward(llama):
    from gptforge.modeling.decoding import generate_hf
    from gptforge.modeling.hf_causal import load_causal_lm

    model, tok = load_causal_lm(str(llama), param="--checkpoint")
    ids = tok(PROMPT)["input_ids"]
    out = generate_hf(model, tok, torch.tensor([ids]), 8, temperature=0)
    assert out.shape == (1, len(ids) + 8) and out[0, : len(ids)].tolist() == ids
    seq = list(ids)
    with torch.no_grad():
        for _ in range(8):  # no cache, the whole sequence each step
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out[0].tolist() == seq
    # top-k 1 samples the argmax; a stop id ends the row right after it, kept
    assert torch.equal(generate_hf(model, tok, torch.tensor([ids]), 8, temperature=0.7, top_k=1), out)
    third = seq[len(ids) + 2]
    stopped = generate_hf(model, tok, torch.tensor([ids]), 8, temperature=0, stop=[third])
    assert stopped[0].tolist() == seq[: seq.index(third, len(ids)) + 1]


def test_generate_hf_sampling_is_seeded_and_ignores_the_folder_s_sampling_defaults(llama, tmp_path):
    from gptforge.modeling.decoding import generate_hf
    from gptforge.modeling.hf_causal import load_causal_lm

    folder = tmp_path / "m"
    shutil.copytree(llama, folder)
    gen_cfg = json.loads((folder / "generation_config.json").read_text())
    # what an instruct model's generation_config.json may say; --temperature/--top-k decide here
    gen_cfg.update(do_sample=True, top_p=0.01, repetition_penalty=5.0, temperature=0.01)
    (folder / "generation_config.json").write_text(json.dumps(gen_cfg))
    model, tok = load_causal_lm(str(folder), param="--checkpoint")
    ids = torch.tensor([tok(PROMPT)["input_ids"]])
    a = generate_hf(model, tok, ids, 16, temperature=1.0, seed=3)
    b = generate_hf(model, tok, ids, 16, temperature=1.0, seed=3)
    c = generate_hf(model, tok, ids, 16, temperature=1.0, seed=4)
    assert torch.equal(a, b) and not torch.equal(a, c)
    # greedy too: the plain folder's greedy tokens, no repetition penalty
    assert generate_hf(model, tok, ids, 8, temperature=0).tolist() == [
        ids[0].tolist() + hf_greedy(llama, ids[0].tolist(), 8)
    ]


def test_chat_on_a_gptforge_checkpoint_is_one_line(tmp_path, small_tokenizer, monkeypatch, capsys):
    from gptforge.cli import main
    from gptforge.modeling.gpt import GPT, GPTConfig
    from gptforge.modeling.weights import save_model

    monkeypatch.chdir(tmp_path)
    save_model(
        GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32, vocab_size=320, n_vocab=281)), tmp_path / "ckpt"
    )
    rc = main(["generate", "hi", "--checkpoint", "ckpt", "--chat", "-S", f"tokenizer.path={small_tokenizer}"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    [line] = error_lines(err)
    assert line.startswith("gptforge: error: --chat needs a Hugging Face causal-LM folder") and "ckpt" in line


# --------------------------------------------------------------------------------------------
# gptforge generate, in a subprocess


@pytest.mark.slow
def test_generate_cli_greedy_equals_transformers_generate(llama, tmp_path):
    r = cli(["generate", PROMPT, "--checkpoint", str(llama), "--temperature", "0", "--max-new-tokens", "12"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    speed = SPEED.match(r.stderr.strip().splitlines()[-1])
    assert speed, r.stderr[-2000:]
    _, tok = load(llama)
    ids = tok(PROMPT)["input_ids"]
    new = hf_greedy(llama, ids, 12)
    assert int(speed.group(1)) == len(new) > 0
    assert r.stdout == tok.decode(new, skip_special_tokens=True) + "\n"


@pytest.mark.slow
def test_generate_cli_chat_sends_the_prompt_through_the_chat_template(llama, tmp_path):
    r = cli(
        [
            "generate",
            "Name a colour.",
            "--checkpoint",
            str(llama),
            "--chat",
            "--temperature",
            "0",
            "--max-new-tokens",
            "10",
        ],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert SPEED.match(r.stderr.strip().splitlines()[-1]), r.stderr[-2000:]
    _, tok = load(llama)
    # the ChatML turn written out by hand (tests/hf_models.py's template); <|endoftext|> is the eos
    ids = tok("<|im_start|>user\nName a colour.<|endoftext|>\n<|im_start|>assistant\n")["input_ids"]
    assert ids.count(tok.eos_token_id) == 1
    assert r.stdout == tok.decode(hf_greedy(llama, ids, 10), skip_special_tokens=True) + "\n"


@pytest.mark.slow
def test_generate_cli_chat_without_a_chat_template_is_one_line(tmp_path):
    folder = make_tiny_causal_lm(tmp_path / "plain", "llama", chat_template=None)
    r = cli(["generate", "hi", "--checkpoint", str(folder), "--chat"], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = last_error_line(r.stderr)
    assert error_lines(r.stderr) == [line]
    assert "--chat" in line and "no chat template" in line and str(folder) in line
    assert r.stdout == ""


# --------------------------------------------------------------------------------------------
# The evaluate stage (on test_evaluate's HellaSwag rows)


def write_mmlu(folder: Path) -> Path:
    for split in ("test", "dev"):
        rows = [
            {
                "question": f"{split} question {n}: what is {n} + 1?",
                "subject": subject,
                "choices": [str(n), str(n + 1), str(n + 2), "none of these"],
                "answer": (n + 1) % 4,
            }
            for s, subject in enumerate(["abstract_algebra", "high_school_biology"])
            for n in range(10 * s, 10 * s + 2)
        ]
        write_jsonl(folder / f"{split}.jsonl", rows)
    return folder


@pytest.fixture
def no_network(monkeypatch):
    """Any connection off the loopback raises and is recorded."""
    attempts = []
    real = socket.socket.connect

    def connect(self, address):
        if not isinstance(address, (str, bytes)) and str(address[0]) not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(address)
            raise OSError(f"test: network call to {address} blocked")
        return real(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    return attempts


def lm_eval_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a (context, continuation) request into ids: trailing context spaces
    go to the continuation, the whole string is encoded and cut at the context's length."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok(context + continuation)["input_ids"]
    return whole[: len(tok(context)["input_ids"])], whole[len(tok(context)["input_ids"]) :]


def raw_loglikelihood(model, ctx: list[int], cont: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ctx + cont])).logits[0].double()
    logp = F.log_softmax(logits[len(ctx) - 1 : -1], dim=-1)
    return float(logp.gather(1, torch.tensor(cont)[:, None]).sum())


@pytest.mark.slow
def test_evaluate_scores_a_hugging_face_folder_with_lm_eval_s_hflm(
    tmp_path, monkeypatch, no_network, qwen, small_tokenizer
):
    from gptforge import evaluate as ev
    from gptforge.config.load import validate
    from gptforge.modeling.gpt import GPT, GPTConfig
    from gptforge.modeling.tokenizer import load_tokenizer
    from gptforge.modeling.weights import load_model, save_model

    monkeypatch.chdir(tmp_path)
    n_vocab = load_tokenizer(str(small_tokenizer)).n_vocab
    torch.manual_seed(0)
    ours = save_model(
        GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=64, vocab_size=n_vocab, n_vocab=n_vocab)),
        tmp_path / "ckpt",
    )
    cfg = validate(
        {
            "tokenizer": {"path": str(small_tokenizer)},
            "tracking": {"enabled": False},
            "evaluate": {
                "tasks": ["hellaswag", "mmlu"],
                "models": {"hf": str(qwen), "gpt": str(ours)},
                "hellaswag": {"source": str(write_jsonl(tmp_path / "hellaswag.jsonl", HELLASWAG))},
                "mmlu": {"source": str(write_mmlu(tmp_path / "mmlu"))},
                "batch_size": 8,
                "limit": 5,
            },
        }
    )
    run = FakeRun()
    metrics = ev.evaluate(cfg, run=run)

    # the same outputs for both kinds of model
    assert json.loads(Path("metrics/evaluate.json").read_text()) == pytest.approx(metrics) == run.metrics[0]
    assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values())
    for name in ("hf", "gpt"):
        assert metrics[f"{name}.hellaswag.n"] == 5 and metrics[f"{name}.mmlu.n"] == 4
        assert f"{name}.hellaswag.acc_norm_stderr" in metrics
        assert metrics[f"{name}.model_seconds"] > 0 and metrics[f"{name}.examples_per_sec"] > 0
        assert metrics[f"{name}.model_seconds"] < metrics[f"{name}.seconds"]
    results = json.loads(Path("reports/evaluate/hf/results.json").read_text())
    # lm-eval names an HFLM by its model's name_or_path; its model info comes from the HFLM
    assert results["config"]["model"] == results["config"]["checkpoint"] == str(qwen)
    assert results["config"]["model_num_parameters"] == sum(p.numel() for p in load(qwen)[0].parameters())
    report = Path("reports/evaluate.md").read_text()
    assert "| hf | hellaswag | acc_norm |" in report and "| gpt | mmlu | acc |" in report
    assert re.search(r"^\| hf \| 9 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \| cpu \|$", report, re.M), report

    # every request's log-likelihood, and so every accuracy, recomputed from the raw models:
    # the Hugging Face folder's logits through transformers, our GPT's in float64
    model, tok = load(qwen)
    assert len(Path("reports/evaluate/hf/samples_hellaswag.jsonl").read_text().splitlines()) == 5
    direct = {
        "hf": scores_from_samples(
            Path("reports/evaluate/hf"),
            lambda context, continuation: (raw_loglikelihood(model, *lm_eval_pair(tok, context, continuation)), None),
            tol=1e-3,
        ),
        "gpt": check_samples_against_model(
            Path("reports/evaluate/gpt"), load_model(ours), load_tokenizer(str(small_tokenizer))
        )[1],
    }
    for name, scores in direct.items():
        subjects = [scores["mmlu_abstract_algebra"], scores["mmlu_high_school_biology"]]
        assert metrics[f"{name}.hellaswag.acc"] == pytest.approx(scores["hellaswag"]["acc"])
        assert metrics[f"{name}.hellaswag.acc_norm"] == pytest.approx(scores["hellaswag"]["acc_norm"])
        assert metrics[f"{name}.mmlu.acc"] == pytest.approx(sum(s["acc"] * s["n"] for s in subjects) / 4)
        assert metrics[f"{name}.mmlu.acc_subject_mean"] == pytest.approx(sum(s["acc"] for s in subjects) / 2)
    assert no_network == []


def test_measured_counts_requests_times_scoring_and_refuses_a_too_long_continuation():
    from gptforge.errors import BadInput
    from gptforge.evaluate.lm import measured

    class LM:  # HFLM's shape: loglikelihood tokenizes, then _loglikelihood_tokens scores
        max_length = 4

        def loglikelihood(self, requests, disable_tqdm=False):
            return self._loglikelihood_tokens([(r, [1], r) for r in requests], disable_tqdm=disable_tqdm)

        def loglikelihood_rolling(self, requests, disable_tqdm=False):
            return [s for s, _ in self._loglikelihood_tokens(requests=[(None, [1], [2])] * 2 * len(requests))]

        def _loglikelihood_tokens(self, requests, disable_tqdm=False, override_bs=None):
            time.sleep(0.01)
            return [(-1.0, True)] * len(requests)

        def generate_until(self, requests, disable_tqdm=False):
            time.sleep(0.01)
            return ["x"] * len(requests)

    lm = measured(LM(), "hf")
    assert lm.loglikelihood([[2], [3, 4]]) == [(-1.0, True)] * 2
    assert lm.loglikelihood_rolling(["a"]) == [-1.0, -1.0]
    assert lm.generate_until(["a", "b", "c"]) == ["x"] * 3
    assert lm.counts == {"loglikelihood": 2, "loglikelihood_rolling": 1, "generate_until": 3}
    assert lm.seconds >= 0.03 and lm.cut_continuations == 0 and lm.name == "hf"
    with pytest.raises(
        BadInput,
        match=r"^evaluate.models.hf: a continuation of 5 tokens does not fit the "
        r"model's 4 positions",
    ):
        lm.loglikelihood([[1, 2, 3, 4, 5]])


# --------------------------------------------------------------------------------------------
# MLflow: the transformers flavor


@pytest.mark.slow
def test_log_hf_model_loads_back_and_generates(llama, tmp_path, monkeypatch, mlflow_uri):
    import mlflow

    from gptforge.runtime import mlflow_values, tracking

    monkeypatch.chdir(tmp_path)
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_uri[len("sqlite:///") :], db)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.delenv(mlflow_values.PARENT_ENV, raising=False)
    assert tracking.NullRun().log_hf_model(llama) is None
    with tracking.start_run(enabled=True, experiment="t", stage="finetune_instruct") as run:
        uri = run.log_hf_model(llama)
    assert uri and uri.startswith("models:/")
    assert (tmp_path / "mlartifacts").is_dir()  # beside the database, as every artifact of the run

    pipe = mlflow.transformers.load_model(uri)
    model, tok = load(llama)
    loaded = pipe.model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    assert pipe.tokenizer.chat_template == CHATML
    ids = tok(PROMPT)["input_ids"]
    [out] = pipe(PROMPT, max_new_tokens=6, do_sample=False)
    assert out["generated_text"] == PROMPT + tok.decode(hf_greedy(llama, ids, 6), skip_special_tokens=True)


@pytest.mark.parametrize("case", ["flavor fails", "not a causal LM"])
def test_log_hf_model_that_cannot_be_logged_is_a_warning(case, llama, tmp_path, caplog):
    from gptforge.runtime.tracking import MlflowRun

    calls = []

    class Mlflow:  # what log_hf_model reaches of mlflow
        class transformers:
            @staticmethod
            def log_model(**kw):
                calls.append(kw)
                raise RuntimeError("the flavor\nbroke")

    run = MlflowRun(Mlflow, type("Run", (), {"info": type("Info", (), {"run_id": "r"})})())
    folder = llama if case == "flavor fails" else make_tiny_encoder(tmp_path / "bert")
    with caplog.at_level(logging.WARNING, logger="gptforge"):
        assert run.log_hf_model(folder) is None
    [record] = [r for r in caplog.records if r.name == "gptforge"]
    message = record.getMessage()
    assert message.startswith(f"MLflow: {folder} not logged as a transformers model (") and "\n" not in message
    if case == "flavor fails":
        [kw] = calls
        assert kw["name"] == "model" and kw["task"] == "text-generation"
        assert {"model", "tokenizer"} == set(kw["transformers_model"])
        assert any(r.startswith("transformers==") for r in kw["pip_requirements"])
        assert "RuntimeError: the flavor broke" in message
    else:
        assert calls == [] and "not a causal language model" in message


@pytest.mark.slow
def test_registered_text_model_takes_max_new_tokens_and_checks_itself_on_few(llama, tmp_path, monkeypatch, mlflow_uri):
    """register's signature and example: `max_new_tokens` is a parameter of the served model
    (default 256, the pipeline's own), and MLflow's serving check generates the example's 16."""
    import json

    import mlflow

    from gptforge.register import EXAMPLE_PARAMS, PROMPT_EXAMPLE, TEXT_SIGNATURE
    from gptforge.runtime import mlflow_values, tracking

    monkeypatch.chdir(tmp_path)
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_uri[len("sqlite:///") :], db)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.delenv(mlflow_values.PARENT_ENV, raising=False)
    import logging

    class Seen(logging.Handler):
        messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    flavor_log = logging.getLogger("mlflow.transformers")
    seen = Seen()
    flavor_log.addHandler(seen)
    try:
        with tracking.start_run(enabled=True, experiment="t", stage="register") as run:
            uri = run.log_hf_model(
                llama,
                input_example=PROMPT_EXAMPLE,
                example_params=EXAMPLE_PARAMS,
                signature=json.loads(json.dumps(TEXT_SIGNATURE)),  # as a journal carries it
            )
    finally:
        flavor_log.removeHandler(seen)
    assert uri
    assert not [m for m in seen.messages if m.startswith("params provided")]  # our own params: no warning
    info = mlflow.models.get_model_info(uri)
    [param] = info.signature.params.params
    assert (param.name, param.default) == ("max_new_tokens", 256)
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp_path / "dl")))
    served = json.loads((local / "serving_input_example.json").read_text())
    assert served["params"] == {"max_new_tokens": 16}

    model = mlflow.pyfunc.load_model(uri)
    _, tok = load(llama)

    def new_tokens(params):
        torch.manual_seed(0)  # the flavor's pipeline samples
        [out] = model.predict([PROMPT], params=params)
        assert out.startswith(PROMPT)
        return len(tok(out)["input_ids"]) - len(tok(PROMPT)["input_ids"])

    assert 0 < new_tokens({"max_new_tokens": 4}) <= 4 < new_tokens({"max_new_tokens": 12})
