"""``load_script(name)``: a script of ``scripts/`` imported as a module (``from script_module
import load_script``: pytest puts ``tests/`` on ``sys.path``)."""

import functools
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.cache
def load_script(name: str):
    """``scripts/<name>.py`` as a module, loaded once (``name`` may be ``probes/<script>``)."""
    path = os.path.join(ROOT, "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(os.path.basename(name), path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod
