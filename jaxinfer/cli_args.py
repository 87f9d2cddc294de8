"""What the command lines share (`jaxinfer.generate`, `jaxinfer.plan`, `jaxinfer.serve`): a parser
whose errors are one line, the help formatter, the engine options built from `EngineConfig`, and
``--model`` -> `LLM`."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from jaxinfer.config import EngineConfig, KernelConfig

ENGINE_OPTIONS = tuple(f.name for f in dataclasses.fields(EngineConfig)  # --seed: the requests'
                       if f.name not in ("seed", "kernels"))


class Parser(argparse.ArgumentParser):
    """An argparse parser whose errors raise ValueError(message) instead of printing the usage
    and exiting (the caller prints one line and exits with code 2)."""

    def error(self, message):
        raise ValueError(message)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" unless the help says it or the default is None, False or []."""

    def _get_help_string(self, action):
        d = action.default
        if "default" in (action.help or "") or d is None or d is False or d == []:
            return action.help or ""
        return super()._get_help_string(action)


def fail(msg: str) -> int:
    """Print ``error: msg`` on stderr; returns the exit code 2."""
    sys.stderr.write(f"error: {msg}\n")
    return 2


def flag(name: str) -> str:
    """``--name-with-dashes`` of a field name."""
    return "--" + name.replace("_", "-")


def _kernels(spec: str) -> KernelConfig:
    try:
        return KernelConfig.parse(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_options(p: argparse.ArgumentParser) -> None:
    """The group of `ENGINE_OPTIONS` (type, default and help from `EngineConfig`) and
    ``--kernels SPEC`` (`KernelConfig.parse`)."""
    g = p.add_argument_group("engine (jaxinfer.config.EngineConfig)")
    for f in dataclasses.fields(EngineConfig):
        if f.name in ENGINE_OPTIONS:  # type from the annotation: "int | None", "bool", ...
            kind = (dict(action=argparse.BooleanOptionalAction) if f.type == "bool" else
                    dict(type=float if "float" in f.type else int if "int" in f.type else str))
            g.add_argument(flag(f.name), default=f.default, **kind, **f.metadata)
    g.add_argument("--kernels", type=_kernels, default=KernelConfig(), metavar="SPEC",
                   help="kernel choices, comma-separated key=value, e.g. decode=mosaic,"
                        "prefill=triton ('auto': chosen for the device). Keys: " + KernelConfig.help())


def make_llm(args: argparse.Namespace, **kwargs):
    """`jaxinfer.llm.LLM` of ``args.model`` (None: the embedded default model) with the engine
    options of ``args`` (`add_engine_options`) and ``kwargs``. Raises FileNotFoundError: no such
    ``--model``; ValueError: as `LLM`."""
    from jaxinfer import llm

    if args.model is not None and not os.path.exists(args.model):
        raise FileNotFoundError(f"--model {args.model!r} does not exist")
    return llm.LLM(args.model, kernels=args.kernels,
                   **{name: getattr(args, name) for name in ENGINE_OPTIONS}, **kwargs)
