"""How the CLI tests run ``python -m jaxinfer.generate``: in a subprocess (`run_cli`) or in this
process (`run_main`), and what it would hand to `LLM` (`llm_kwargs`)."""

import os
import subprocess
import sys

import pytest

ENV = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")


def run_cli(*args, timeout=600, cmd=("-m", "jaxinfer.generate")):
    return subprocess.run(
        [sys.executable, *cmd, *args], capture_output=True, text=True, env=ENV, timeout=timeout
    )


def run_main(capsys, *args):
    """``python -m jaxinfer.generate ARGS`` in this process: (exit code, stdout, stderr)."""
    from jaxinfer import generate

    try:
        code = generate.main(list(args))
    except SystemExit as e:  # argparse errors exit from inside parse_args
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def llm_kwargs(monkeypatch, capsys, *args) -> dict:
    """The keyword arguments ``python -m jaxinfer.generate ARGS`` hands to `LLM`."""
    import jaxinfer.llm

    class Seen(Exception):
        pass

    def fake_llm(*_args, **kwargs):
        raise Seen(kwargs)

    monkeypatch.setattr(jaxinfer.llm, "LLM", fake_llm)
    with pytest.raises(Seen) as e:
        run_main(capsys, "--prompt", "hi", *args)
    return e.value.args[0]
