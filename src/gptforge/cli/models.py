"""`gptforge export` and `gptforge models list|promote`: checkpoints as Hugging Face folders or
GGUF files (llama.cpp, Ollama), and the versions of the MLflow Model Registry."""

from __future__ import annotations

import sys

from gptforge.cli.parsing import Parser, config_args, params_file


def add_commands(sub) -> None:
    """`export` and `models list|promote`."""
    e = sub.add_parser(
        "export",
        help="export a checkpoint as a Hugging Face folder or a GGUF file (llama.cpp, Ollama)",
        description="--format hf: a folder that transformers' AutoModelForCausalLM and AutoTokenizer load. "
        "--format gguf: one .gguf file (weights, tokenizer, chat template) and an Ollama Modelfile beside it "
        "(docs/gguf.md).",
    )
    e.add_argument("--checkpoint", required=True, metavar="DIR")
    e.add_argument("--out", required=True, metavar="PATH", help="a folder (hf) or a .gguf file (gguf)")
    e.add_argument("--format", choices=("hf", "gguf"), default="hf", help="(default: %(default)s)")
    e.add_argument(
        "--quant", default="f16", metavar="TYPE", help="GGUF tensor type: f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0"
    )
    config_args(e)
    e.set_defaults(func=cmd_export)

    models = sub.add_parser(
        "models",
        help="the registered models: list their versions, promote one",
        description="The MLflow Model Registry at MLFLOW_TRACKING_URI (default: "
        "sqlite:///mlflow.db), as the register stage fills it (docs/registry.md).",
    )
    models_sub = models.add_subparsers(dest="models_command", metavar="ACTION", parser_class=Parser)
    models_sub.required = True
    m = models_sub.add_parser(
        "list",
        help="every version of every registered model, newest first",
        description="One row per version: aliases, creation time, the promotion gate's verdict and the key metrics.",
    )
    m.add_argument("--name", metavar="NAME", help="only this model (registered name, or a key of registry.names)")
    config_args(m)
    m.set_defaults(func=cmd_models_list)
    m = models_sub.add_parser(
        "promote",
        help="give a model version an alias (default: champion)",
        description="Move ALIAS to VERSION of NAME and say which version held it before.",
    )
    m.add_argument("name", metavar="NAME", help="registered name, or a key of registry.names (classify)")
    m.add_argument("version", metavar="VERSION")
    m.add_argument("--alias", default="champion", help="(default: %(default)s)")
    config_args(m)
    m.set_defaults(func=cmd_models_promote)
    m = models_sub.add_parser(
        "gguf",
        help="download a version's GGUF file and Ollama Modelfile (registry.gguf writes them)",
        description="Download the GGUF copy of NAME@ALIAS (or a version number) that the register stage "
        "logged with it (registry.gguf) into the folder OUT: then `ollama create NAME -f OUT/Modelfile`.",
    )
    m.add_argument("name", metavar="NAME", help="registered name, or a key of registry.names (instruct)")
    m.add_argument("--alias", default="champion", help="an alias or a version number (default: %(default)s)")
    m.add_argument("--quant", default=None, help="which copy when there are several (default: registry.gguf's)")
    m.add_argument("--out", required=True, metavar="DIR", help="a new folder for the .gguf file and the Modelfile")
    config_args(m)
    m.set_defaults(func=cmd_models_gguf)


def cmd_export(args) -> int:
    from gptforge.config.load import load_config
    from gptforge.modeling.export import export_hf

    cfg = load_config(params_file(args), args.set)
    if args.format == "gguf":
        from gptforge.finetune.templates import ollama_template, prompt_template
        from gptforge.modeling.gguf_out import export_gguf

        out = export_gguf(
            args.checkpoint,
            args.out,
            args.quant,
            cfg.tokenizer.path,
            ollama_template(prompt_template(cfg.instruct.template)),
        )
        modelfile = out.parent / "Modelfile"
        print(f"gptforge: exported {args.checkpoint} to {out} ({args.quant}) and {modelfile}", file=sys.stderr)
        return 0
    out = export_hf(args.checkpoint, args.out, cfg.tokenizer.path)
    print(f"gptforge: exported {args.checkpoint} to {out}", file=sys.stderr)
    return 0


def cmd_models_list(args) -> int:
    from gptforge.config.load import load_config
    from gptforge.register.models import format_table, list_models, no_models_line

    cfg = load_config(params_file(args), args.set)
    rows = list_models(cfg, args.name)
    print(format_table(rows) if rows else no_models_line(args.name and cfg.registry.names.get(args.name, args.name)))
    return 0


def cmd_models_promote(args) -> int:
    from gptforge.config.load import load_config
    from gptforge.register.models import promote

    print(promote(load_config(params_file(args), args.set), args.name, args.version, args.alias))
    return 0


def cmd_models_gguf(args) -> int:
    from gptforge.config.load import load_config
    from gptforge.register.gguf import pull_gguf

    path = pull_gguf(load_config(params_file(args), args.set), args.name, args.out, args.alias, args.quant)
    print(f"gptforge: {path} and {path.parent / 'Modelfile'} (ollama create NAME -f {path.parent / 'Modelfile'})")
    return 0
