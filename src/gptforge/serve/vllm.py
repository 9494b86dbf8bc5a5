"""`gptforge serve --engine vllm`: one language model through vLLM's own OpenAI-compatible server.

vLLM is GPU software with its own pins (vLLM 0.33 wants torch 2.14 and transformers < 5.21,
gptforge runs torch 2.13), so the GPU image (docker/Dockerfile) installs it in a virtual
environment of its own, /opt/vllm, named by GPTFORGE_VLLM_PYTHON. `vllm_python` finds the
interpreter to run it with: this one when it imports vllm, else GPTFORGE_VLLM_PYTHON; neither is
a one-line BadInput that says `--engine gptforge` (the default) serves here.

vLLM's server serves one model per process and has no classification route, so exactly one
language model is accepted. A Hugging Face folder is served as it is; a gptforge checkpoint is
first exported with `gptforge.modeling.export` into the serving cache (`sources.cache_dir()/export/`),
again only when its weights or the tokenizer changed, with the pipeline's instruct template
(`instruct.template` alpaca or phi3) as a Jinja chat template, so that /v1/chat/completions
works and renders a conversation as our own engine does. The server runs as a child in its own
process group (`python -m vllm.entrypoints.cli.main serve`, what the `vllm serve` script runs;
the `vllm.entrypoints.openai.api_server` module is deprecated in 0.33), with our SIGINT/SIGTERM
forwarded to it; the API key goes in its environment (VLLM_API_KEY), not on a command line that
every user of the machine can read (vLLM checks it on /v1, /v2 and /inference, not on its
/invocations route: a warning says so for a host other than loopback). `vllm_command` builds
the command and is tested on its own.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from gptforge.errors import BadInput
from gptforge.serve.sources import ModelSource, cache_dir

log = logging.getLogger("gptforge")

PYTHON_ENV = "GPTFORGE_VLLM_PYTHON"
EXPORT_MARKER = ".gptforge-export.json"
CHAT_TEMPLATE_FILE = "gptforge_chat_template.jinja"
LANGUAGE_MODELS = ("hf", "gptforge")
# Where a Hugging Face config.json states the model's context length, most common first.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def vllm_python() -> str:
    """The Python that runs vLLM: this interpreter when vllm imports here, else $GPTFORGE_VLLM_PYTHON
    (the GPU image's /opt/vllm); BadInput when there is none."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    other = os.environ.get(PYTHON_ENV)
    if other and os.access(other, os.X_OK):
        return other
    where = f" ({PYTHON_ENV}={other} is not an executable)" if other else ""
    raise BadInput(
        f"--engine vllm: vllm is not installed here{where}; it is GPU software, installed in the GPU worker "
        "image (docker/Dockerfile, /opt/vllm); `--engine gptforge` (the default) serves on this machine"
    )


def pick_model(sources: Sequence[ModelSource]) -> ModelSource:
    """The one language model vLLM can serve; BadInput for a classifier or a second model."""
    classifiers = [s for s in sources if s.kind not in LANGUAGE_MODELS]
    if classifiers:
        raise BadInput(
            f"--engine vllm: {classifiers[0].name} is a classifier; vLLM's OpenAI server serves one "
            "language model per process and no classifier: name only the language model (gptforge serve "
            "--engine vllm models:/gptforge-instruct@champion) and serve the classifier with --engine "
            "gptforge"
        )
    if len(sources) != 1:
        names = ", ".join(s.name for s in sources) or "none"
        raise BadInput(
            f"--engine vllm: vLLM's OpenAI server serves one model per process, got {len(sources)} "
            f"({names}): start one server per model, each on its own --port"
        )
    return sources[0]


def context_length(folder: Path) -> int | None:
    """The context length a Hugging Face config.json states, or None."""
    from gptforge.modeling.hf_causal import CONFIG_FILE, hf_config_dict

    config = hf_config_dict(Path(folder) / CONFIG_FILE) or {}
    for key in _CONTEXT_KEYS:
        if isinstance(config.get(key), int) and config[key] > 0:
            return config[key]
    return None


def vllm_command(
    python: str,
    model_dir: str | os.PathLike,
    *,
    name: str,
    host: str,
    port: int,
    max_model_len: int | None = None,
    tokenizer: str | os.PathLike | None = None,
    chat_template: str | os.PathLike | None = None,
) -> list[str]:
    """The command line of vLLM's OpenAI-compatible server for the Hugging Face folder `model_dir`,
    served as `name`; the tokenizer only when it is not the model folder's own."""
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model_dir),
        "--served-model-name",
        name,
        "--host",
        host,
        "--port",
        str(port),
    ]
    if max_model_len is not None:
        cmd += ["--max-model-len", str(max_model_len)]
    if tokenizer is not None and Path(tokenizer) != Path(model_dir):
        cmd += ["--tokenizer", str(tokenizer)]
    if chat_template is not None:
        cmd += ["--chat-template", str(chat_template)]
    return cmd


def chat_template(template: str) -> str | None:
    """`instruct.template` (alpaca, phi3) as a Jinja chat template that renders a conversation as
    `gptforge.serve.loading.render_conversation` does for our own engine (each user turn in the
    template, each assistant turn followed by a blank line, system messages before the first
    instruction), so both engines prompt a model alike; None for `chat` (a Hugging Face
    tokenizer's own template, which an export does not have)."""
    from gptforge.finetune.templates import render

    if template not in ("alpaca", "phi3"):
        return None
    marker = "\x00instruction\x00"
    prefix, suffix = render({"instruction": marker, "input": "", "output": ""}, template)[0].split(marker)
    # Every text is emitted as a Jinja string literal (JSON's escapes are Jinja's): whitespace
    # control around the tags must not eat the template's own newlines.
    return (
        "{%- if messages[-1]['role'] != 'user' -%}{{ raise_exception('messages must end with a user message') }}"
        "{%- endif -%}"
        "{%- set ns = namespace(system='', n=0, first=true) -%}"
        "{%- for m in messages if m['role'] in ['system', 'developer'] -%}"
        "{%- if ns.n > 0 -%}{%- set ns.system = ns.system ~ '\\n\\n' -%}{%- endif -%}"
        "{%- set ns.system = ns.system ~ m['content'] -%}{%- set ns.n = ns.n + 1 -%}"
        "{%- endfor -%}"
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'user' -%}"
        "{%- set instruction = (ns.system ~ '\\n\\n' ~ m['content']) if ns.first and ns.system else m['content'] -%}"
        f"{{{{ {json.dumps(prefix)} ~ instruction ~ {json.dumps(suffix)} }}}}"
        "{%- set ns.first = false -%}"
        "{%- elif m['role'] == 'assistant' -%}{{ m['content'] ~ '\\n\\n' }}"
        "{%- endif -%}"
        "{%- endfor -%}"
    )


def exported(source: ModelSource, cfg) -> Path:
    """A Hugging Face folder of the gptforge checkpoint `source`, exported into the cache unless
    the cache holds one of the same weights, tokenizer and instruct template."""
    from gptforge.io import write_json
    from gptforge.modeling.export import export_hf
    from gptforge.register.lineage import folder_hash

    checkpoint = source.path.resolve()
    out = cache_dir() / "export" / hashlib.sha256(str(checkpoint).encode("utf-8")).hexdigest()[:16]
    tokenizer = str(source.tokenizer) if source.tokenizer is not None else None
    marker = {
        "checkpoint": str(checkpoint),
        "weights": folder_hash(checkpoint),
        "tokenizer": tokenizer,
        "template": cfg.instruct.template,
    }
    try:
        if json.loads((out / EXPORT_MARKER).read_text(encoding="utf-8")) == marker:
            return out
    except (OSError, ValueError):
        pass
    log.info("serve: exporting %s as a Hugging Face folder into %s for vLLM", source.path, out)
    export_hf(checkpoint, out, tokenizer)
    template = chat_template(cfg.instruct.template)
    if template is not None:
        (out / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    write_json(out / EXPORT_MARKER, marker)
    return out


def run_vllm(sources: list[ModelSource], *, host: str, port: int, api_key: str | None, cfg) -> int:
    """Serve the one language model of `sources` with vLLM until it exits; its exit code (128 +
    the signal when a signal ended it)."""
    from gptforge.runtime.signals import forwarded_to

    python = vllm_python()
    source = pick_model(sources)
    folder, tokenizer, template = source.path, source.tokenizer, None
    if source.kind == "gptforge":
        folder = exported(source, cfg)
        tokenizer = folder
        if (folder / CHAT_TEMPLATE_FILE).is_file():
            template = folder / CHAT_TEMPLATE_FILE
    cmd = vllm_command(
        python,
        folder,
        name=source.name,
        host=host,
        port=port,
        max_model_len=context_length(folder),
        tokenizer=tokenizer,
        chat_template=template,
    )
    env = dict(os.environ)
    if api_key:
        env["VLLM_API_KEY"] = api_key
        if host not in ("127.0.0.1", "localhost", "::1"):
            log.warning(
                "serve: vLLM checks the API key on /v1, /v2 and /inference only; its /invocations route "
                "serves the model without it: do not rely on the key on %s",
                host,
            )
    log.info("serve: %s (%s) through vLLM on http://%s:%d/v1", source.name, folder, host, port)
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        raise BadInput(f"--engine vllm: cannot start {python} ({e.strerror or e})") from None
    with forwarded_to(proc) as received:
        rc = proc.wait()
    if rc < 0:
        return 128 - rc
    return 128 + received[0] if received and rc == 0 else rc
