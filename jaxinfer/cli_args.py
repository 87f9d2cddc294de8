"""What the command lines share (`jaxinfer.generate`, `jaxinfer.serve`,
``scripts/convert_checkpoint.py``, ``scripts/plan_memory.py``): a parser whose errors are one line
(`fail`), and for the engine's command lines ``--model`` (a path or hub id; `HUB_OPTIONS`), the
engine options built from `EngineConfig` and ``--model`` -> `LLM`."""

import argparse
import dataclasses
import os
import sys

from jaxinfer.config import EngineConfig, KernelConfig, SpeculativeConfig
from jaxinfer.config.vllm_args import VLLM_NO_EFFECT

ENGINE_OPTIONS = tuple(
    f.name
    for f in dataclasses.fields(EngineConfig)  # --seed: the requests'
    if f.name not in ("seed", "kernels")
)


# vLLM's command-line flags among `VLLM_NO_EFFECT`, by type (copied `vllm serve` command lines
# run; a value other than vLLM's default logs that it changes nothing)
NO_EFFECT_OPTIONS = {
    "trust_remote_code": bool,
    "disable_log_stats": bool,
    "enable_chunked_prefill": bool,
    "swap_space": float,
    "tokenizer_mode": str,
    "max_cpu_loras": int,
}
HUB_OPTIONS = (  # vLLM's: a --model or --tokenizer that is a hub id (checkpoints_tools.hub)
    ("revision", "the model's hub revision: a branch, tag or commit id (default: main)"),
    ("tokenizer_revision", "the --tokenizer hub id's revision (default: main)"),
    ("download_dir", "hub cache directory (default: $HF_HUB_CACHE, else $HF_HOME/hub)"),
    ("hf_token", "Hugging Face token for gated or private models (default: the hub's login)"),
)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" unless the help says it or the default is None, False or []."""

    def _get_help_string(self, action):
        d = action.default
        if "default" in (action.help or "") or d is None or d is False or d == []:
            return action.help or ""
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An argparse parser (`HelpFormatter`) whose errors raise ValueError(message) instead of
    printing the usage and exiting (the caller prints one line and exits with code 2)."""

    def __init__(self, prog: str, description: str) -> None:
        super().__init__(prog=prog, description=description, formatter_class=HelpFormatter)

    def error(self, message):
        raise ValueError(message)


def fail(msg: str) -> int:
    """Print ``error: msg`` (its whitespace runs as one space) on stderr; returns exit code 2."""
    sys.stderr.write(f"error: {' '.join(msg.split())}\n")
    return 2


def flag(name: str) -> str:
    """``--name-with-dashes`` of a field name."""
    return "--" + name.replace("_", "-")


def _parsed_by(parse):
    """An argparse ``type`` calling ``parse(str)``: its ValueError's message is argparse's error
    (``argument --flag: message``), not argparse's generic "invalid value"."""

    def parsed(spec: str):
        try:
            return parse(spec)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parsed.__name__ = parse.__name__
    return parsed


_PARSED = {"speculative_config": _parsed_by(SpeculativeConfig.from_value)}  # str -> the field


def engine_parser(prog: str, description: str) -> Parser:
    """A `Parser` with ``--model``, the group of `ENGINE_OPTIONS` (type, default and help from
    `EngineConfig`; ``--speculative-config JSON``: `SpeculativeConfig.from_value`) and
    ``--kernels SPEC`` (`KernelConfig.parse`)."""
    p = Parser(prog, description)
    p.add_argument(
        "--model",
        default=None,
        help="HF model dir, GGUF file, Orbax dir or Hugging Face hub id (default: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    for name, help in HUB_OPTIONS:
        p.add_argument(flag(name), default=None, help=help)
    g = p.add_argument_group("engine (jaxinfer.config.EngineConfig)")
    for f in (f for f in dataclasses.fields(EngineConfig) if f.name in ENGINE_OPTIONS):
        kind = (
            dict(type=_PARSED[f.name])
            if f.name in _PARSED
            else dict(action=argparse.BooleanOptionalAction)
            if f.type == "bool"
            # f.type: str
            else dict(type=float if "float" in f.type else int if "int" in f.type else str)
        )
        g.add_argument(flag(f.name), default=f.default, **kind, **f.metadata)
    g.add_argument(
        "--kernels",
        type=_parsed_by(KernelConfig.parse),
        default=KernelConfig(),
        metavar="SPEC",
        help="kernel choices, comma-separated key=value, e.g. decode=mosaic,"
        "prefill=triton ('auto': chosen for the device). Keys: " + KernelConfig.help(),
    )
    v = p.add_argument_group("vLLM options that change nothing here (a warning says why)")
    for name, kind in NO_EFFECT_OPTIONS.items():
        how = dict(action=argparse.BooleanOptionalAction) if kind is bool else dict(type=kind)
        v.add_argument(flag(name), default=None, help=VLLM_NO_EFFECT[name][1], **how)
    return p


class _Once(argparse.Action):
    """Stores an option's value; given twice: argparse's error naming both values."""

    def __call__(self, parser, namespace, values, option_string=None):
        if (prev := getattr(namespace, self.dest)) is not None:
            raise argparse.ArgumentError(
                self,
                f"given twice ({prev!r}, {values!r}): allowed once (one adapter for every prompt; "
                "several: LLM.generate's lora_request list or the server's --lora-modules)",
            )
        setattr(namespace, self.dest, values)


def add_lora_path(p: Parser) -> None:
    """``--lora-path PATH`` on ``p``: one LoRA adapter for every prompt (`lora_request`), at
    most once; ``--enable-lora``'s default becomes None (on with ``--lora-path``, else off;
    ``--no-enable-lora --lora-path``: an error in `make_llm`)."""
    p.add_argument(
        "--lora-path",
        action=_Once,
        default=None,
        metavar="PATH",
        help="a PEFT LoRA adapter directory applied to every prompt (LoRARequest('cli', 1, "
        "PATH); implies --enable-lora; docs/lora.md)",
    )
    p.set_defaults(enable_lora=None)


def lora_request(args: argparse.Namespace):
    """The `LoRARequest` of ``args.lora_path`` (name "cli", id 1), or None."""
    from jaxinfer.lora.request import LoRARequest

    path = getattr(args, "lora_path", None)
    return None if path is None else LoRARequest("cli", 1, path)


def _lora_path_options(args: argparse.Namespace, opts: dict) -> None:
    """``opts["enable_lora"]`` for ``args.lora_path`` (`add_lora_path`): on with a path (the
    LoRA flags, then the adapter's files checked), else off unless ``--enable-lora``.
    ValueError: ``--no-enable-lora`` with a path, as `EngineConfig` (``--max-lora-rank``,
    ``--max-loras``), as `jaxinfer.lora.peft.check_adapter`."""
    from jaxinfer.lora.peft import check_adapter

    if (path := getattr(args, "lora_path", None)) is None:
        opts["enable_lora"] = bool(opts["enable_lora"])
        return
    if opts["enable_lora"] is False:
        raise ValueError(
            f"--lora-path {path!r} needs LoRA on: drop --no-enable-lora (--lora-path implies "
            "--enable-lora)"
        )
    EngineConfig(enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    check_adapter(path, args.max_lora_rank)
    opts["enable_lora"] = True


def make_llm(args: argparse.Namespace, **kwargs):
    """`jaxinfer.llm.LLM` of ``args.model`` (None: the embedded default model) with the engine
    options of ``args`` (`engine_parser`, `HUB_OPTIONS` included) and ``kwargs``; transformers'
    warnings are silenced (they would break the one-line error contract). ``args.lora_path``
    (`add_lora_path`), if set: ``enable_lora`` on, the LoRA flags and the adapter's files checked
    first (`_lora_path_options`). Raises FileNotFoundError (no such ``--model``, or the hub's
    error for a hub id: `LLM`'s message), ValueError: as `LLM`, as `_lora_path_options` (before
    the model loads)."""
    from jaxinfer import llm

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    opts = {name: getattr(args, name) for name in (*ENGINE_OPTIONS, *(n for n, _ in HUB_OPTIONS))}
    opts |= {n: v for n in NO_EFFECT_OPTIONS if (v := getattr(args, n, None)) is not None}
    _lora_path_options(args, opts)
    if "precompile" in opts and opts["precompile"] is None:  # the server's default
        import jax

        opts["precompile"] = jax.default_backend() == "gpu"
    return llm.LLM(args.model, kernels=args.kernels, **opts, **kwargs)
