"""`gptforge config show`: the resolved configuration (params file, merged over the files it
`extends`, + overrides) as YAML; and
`gptforge plan`: what that configuration's training needs of each GPU (gptforge.training.memory_plan)."""

from __future__ import annotations

import sys

from gptforge.cli.parsing import Parser, config_args, params_file


def add_commands(sub) -> None:
    """`config show` and `plan`."""
    config = sub.add_parser("config", help="inspect the resolved configuration")
    config_sub = config.add_subparsers(dest="config_command", metavar="ACTION", parser_class=Parser)
    config_sub.required = True
    show = config_sub.add_parser(
        "show",
        help="print the resolved config (params file merged over the files it extends, + overrides) as YAML, every key",
    )
    config_args(show)
    show.set_defaults(func=cmd_config_show)

    plan = sub.add_parser(
        "plan",
        help="bytes of training state per GPU under ddp, zero1 and fsdp, and what fits",
        description="For the model of the config's main training stage (pretrain, or instruct "
        "when it fine-tunes a model other than its own pretrained one), print the bytes each "
        "GPU holds of weights, gradients and AdamW states under each strategy, an estimate of "
        "the activations, and whether the total fits. Offline: the model is counted on the "
        "meta device from the config, a local config.json or a table of known architectures.",
    )
    plan.add_argument(
        "--gpus",
        type=int,
        default=None,
        metavar="N",
        help="GPUs in all (default: the stage's nproc_per_node x distributed.nnodes)",
    )
    plan.add_argument("--gpu-memory", default="80GB", metavar="SIZE", help="memory of one GPU (default: %(default)s)")
    plan.add_argument(
        "--stage",
        choices=["pretrain", "instruct"],
        default=None,
        help="plan this stage's model instead of the main one",
    )
    config_args(plan)
    plan.set_defaults(func=cmd_plan)


def cmd_config_show(args) -> int:
    from gptforge.config.load import dump_yaml, load_config

    cfg = load_config(params_file(args), args.set)
    sys.stdout.write(dump_yaml(cfg))
    return 0


def cmd_plan(args) -> int:
    from gptforge.config.load import load_config
    from gptforge.errors import BadInput
    from gptforge.training import memory_plan as mp

    cfg = load_config(params_file(args), args.set)
    stage = args.stage or mp.main_stage(cfg)
    gpus = args.gpus if args.gpus is not None else cfg.world_size(stage)
    if gpus < 1:
        raise BadInput(f"--gpus must be >= 1, got {gpus}")
    memory = mp.parse_memory(args.gpu_memory)
    shape = mp.gpt_shape(cfg) if stage == "pretrain" else mp.hf_shape(cfg, gpus)
    print(f"stage: {stage}")
    print(mp.render(shape, mp.state_rows(shape, gpus), gpus, memory))
    return 0
