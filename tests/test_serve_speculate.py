"""Speculative decoding in `gptforge serve` (`--speculate K`): the lean backend's verify step
(`HFBackend.decode_greedy_draft`) returns, for drafts right up to any point, exactly the greedy
tokens of the model's plain forward over the whole sequence and leaves the row as if it had
decoded them one by one; the scheduler drafts for a lone greedy row only, and a served answer
is token for token the one without speculation (float32), in fewer steps; a stop id among the
kept drafts ends the answer there."""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_models import tiny_llama_config

from gptforge.errors import BadInput
from gptforge.serve.engine_core import execute, stats_of, step
from gptforge.serve.hf_backend import HFBackend
from gptforge.serve.sampling import Sampling
from gptforge.serve.scheduler import Job, Scheduler

torch.set_num_threads(1)
VOCAB = 64


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config(VOCAB)).float().eval()


@torch.inference_mode()
def plain_greedy(model, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens by the model's full forward over the whole sequence each time."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


def repeating_prompt(seed: int = 3) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    part = torch.randint(1, VOCAB, (12,), generator=g).tolist()
    return part + part + part[:5]  # the model's answer tends to copy it on


def test_verify_keeps_the_greedy_tokens_and_rewinds_the_row(model):
    prompt = repeating_prompt()
    want = plain_greedy(model, prompt, 24)
    backend = HFBackend(model, 4, 256)
    assert backend.verifies_drafts
    backend.open_row()
    first = int(backend.forward([(0, prompt)])[0].argmax())
    assert first == want[0]
    got, last = [first], first
    for right in [0, 3, 1, 4, 2, 0]:  # drafts of 4 tokens, the first `right` of them greedy's
        at = len(got)
        draft = want[at : at + right] + [(t + 1) % VOCAB for t in want[at + right : at + 4]]
        tokens = backend.decode_greedy_draft(last, draft)
        assert tokens == want[at : at + right + 1], (right, draft)
        assert backend._rows[0].length == len(prompt) + len(got) + right
        got += tokens
        last = got[-1]
    # the row goes on as if it had decoded every token one at a time
    for _ in range(3):
        nxt = backend.decode_greedy(last)
        got.append(nxt)
        last = nxt
    assert got == want[: len(got)]


def test_only_a_lean_backend_verifies(model):
    hooked = transformers.LlamaForCausalLM(model.config).eval()
    hooked.register_forward_hook(lambda *a: None)  # not plain: transformers' forward serves it
    backend = HFBackend(hooked, 2, 256)
    assert not backend.verifies_drafts
    assert Scheduler(backend, speculate=4).speculate == 0
    with pytest.raises(ValueError, match="one row of a lean-decoded model"):
        backend.decode_greedy_draft(1, [2])


def serve_alone(model, prompt, n, speculate, stop=frozenset()) -> tuple[list[int], Scheduler]:
    scheduler = Scheduler(HFBackend(model, 4, 256), speculate=speculate)
    job = Job(0, prompt, Sampling(temperature=0.0, max_tokens=n), stop)
    scheduler.add(job)
    while scheduler.has_work:
        step(scheduler)
    return job.fed, scheduler


def test_served_answer_is_plain_greedy_in_fewer_steps(model):
    prompt = repeating_prompt()
    plain, s0 = serve_alone(model, prompt, 40, 0)
    fast, s4 = serve_alone(model, prompt, 40, 4)
    assert fast == plain == plain_greedy(model, prompt, 40)
    stats = stats_of(s4)
    assert stats.drafted_tokens > 0 and 0 < stats.accepted_tokens <= stats.drafted_tokens
    assert s4.steps == s0.steps - stats.accepted_tokens  # each kept draft is a step saved
    assert stats_of(s0).drafted_tokens == 0


class Scripted:
    """A backend whose one row's greedy answer is `answer`, verifying drafts against it."""

    verifies_drafts = True
    max_batch, context = 4, 256

    def __init__(self, answer: list[int]):
        self.answer, self.done, self.verified = answer, 0, []

    def open_row(self, prefix=None):
        pass

    def keep(self, rows):
        pass

    def forward(self, segments):  # the prompt: the answer's first token
        logits = torch.zeros(len(segments), VOCAB)
        logits[:, self.answer[0]] = 1
        self.done = 1
        return logits

    def decode_greedy_draft(self, token, draft):
        want = self.answer[self.done : self.done + len(draft) + 1]
        kept = next((i for i, (d, w) in enumerate(zip(draft, want)) if d != w), len(draft))
        self.done += kept + 1
        self.verified.append(want[: kept + 1])
        return want[: kept + 1]


def test_a_stop_id_among_kept_drafts_ends_the_answer():
    answer = [5, 6, 7, 8, 9, 10, 11, 12]
    backend = Scripted(answer)
    scheduler = Scheduler(backend, speculate=6)
    job = Job(0, [1, 2, 5, 6, 7, 8, 9, 10, 11, 12, 3, 2], Sampling(temperature=0.0, max_tokens=20), {9})
    scheduler.add(job)
    drawn = []
    while scheduler.has_work:
        drawn += [token for _, token in step(scheduler)]
    assert backend.verified == [[6, 7, 8, 9, 10, 11, 12]]  # one step verified the lot
    assert job.fed == drawn == [5, 6, 7, 8, 9] and job.ended  # and the answer ended at its stop id
    assert (scheduler.drafted_tokens, scheduler.accepted_tokens) == (6, 6)


def test_max_tokens_and_other_rows_bound_the_draft(model):
    prompt = repeating_prompt()
    scheduler = Scheduler(HFBackend(model, 4, 256), speculate=8)
    job = Job(0, prompt, Sampling(temperature=0.0, max_tokens=3), frozenset())
    scheduler.add(job)
    while scheduler.has_work:
        plan = scheduler.schedule()
        assert len(plan.draft) <= max(0, 3 - len(job.fed) - 1)
        scheduler.update(plan, execute(scheduler.backend, plan))
    assert len(job.fed) == 3
    # two rows, or a sampled row: no draft
    scheduler = Scheduler(HFBackend(model, 4, 256), speculate=4)
    scheduler.add(Job(1, prompt, Sampling(temperature=0.0, max_tokens=8), frozenset()))
    scheduler.add(Job(2, prompt, Sampling(temperature=0.8, max_tokens=8, seed=1), frozenset()))
    while scheduler.has_work:
        plan = scheduler.schedule()
        assert not plan.draft
        scheduler.update(plan, execute(scheduler.backend, plan))


def test_a_gptforge_gpt_cannot_speculate(tmp_path):
    from gptforge.modeling.gpt import GPT, GPTConfig
    from gptforge.modeling.weights import save_model
    from gptforge.serve.engine_process import EngineSpec, build_scheduler

    model = GPT(GPTConfig(block_size=32, vocab_size=VOCAB, n_vocab=VOCAB, n_layer=1, n_head=2, n_embd=16))
    save_model(model, tmp_path / "gpt")
    with pytest.raises(BadInput, match="--speculate runs in gptforge's lean Llama-family decoder"):
        build_scheduler(EngineSpec("gptforge", str(tmp_path / "gpt"), speculate=4, prefix_cache_mb=0))


def test_the_server_speculates_for_a_lone_greedy_request(tmp_path):
    """`gptforge serve --speculate 4` through the official client: the greedy answer is `gptforge
    generate`'s and /metrics counts the drafts the model kept."""
    import openai
    from hf_models import make_tiny_causal_lm
    from serve_api_support import metric
    from serve_support import Server, cli_generate

    folder = make_tiny_causal_lm(tmp_path / "llama", "llama", max_positions=1024)
    # a model that repeats its last token (its layers add nothing, the head is the unit-norm
    # embedding): an answer that prompt lookup drafts right
    copier = transformers.LlamaForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        embed = copier.model.embed_tokens.weight
        embed /= embed.norm(dim=1, keepdim=True)
        copier.lm_head.weight.copy_(embed)
        for layer in copier.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    copier.save_pretrained(folder)
    prompt = "one two three four five six seven one two three four five six seven one two three"
    expected = cli_generate(folder, prompt, 48)
    srv = Server([f"llama={folder}"], tmp_path, "--speculate", "4")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(model="llama", prompt=prompt, max_tokens=48, temperature=0)
        assert got.choices[0].text == expected
        drafted = metric(srv, "gptforge_speculative_drafted_tokens_total")
        accepted = metric(srv, "gptforge_speculative_accepted_tokens_total")
        assert 0 < accepted <= drafted
    finally:
        srv.stop()
