"""The package's modules import without cycles: module-level imports between `jaxinfer`,
`pallas_kernels` and `checkpoints_tools` modules (a submodule import also runs its parent
package's ``__init__``) form no loop, so each module imports first in a fresh interpreter."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jaxinfer", "pallas_kernels", "checkpoints_tools")


def _modules() -> dict[str, str]:
    """Dotted module name -> file path of every module of `PACKAGES`."""
    out = {}
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(d, f)
    return out


def _edges(name: str, path: str, modules) -> set[str]:
    """Modules of the package that importing ``name`` runs at module level (parents of a
    submodule included, the three top-level packages left out: they are always started first)."""
    targets = set()
    tree = ast.parse(open(path).read())
    for node in tree.body:
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets.add(node.module)
            targets |= {f"{node.module}.{a.name}" for a in node.names}
    deps = set()
    for t in targets:
        parts = t.split(".")
        deps |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)}
    parent = name.rsplit(".", 1)[0] if name.count(".") > 1 else None
    return {d for d in deps if d in modules and d != name and d != parent}


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _edges(m, p, modules) for m, p in modules.items()}
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                cycles.append(" -> ".join(stack[stack.index(d) :] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert len(graph) > 50 and any(graph.values())
    assert cycles == []


def test_host_side_imports_no_jax():
    """The engine's host side (the engine, scheduler, block manager, output processing) and the
    server's API process (app, endpoints, the engine core's client, and the core's module, whose
    factory loads JAX in the child only) run in a fresh interpreter without loading JAX or Flax."""
    import subprocess
    import sys

    host = [
        "jaxinfer.engine.llm_engine",
        "jaxinfer.engine.scheduler",
        "jaxinfer.outputs",
        "jaxinfer.engine.block_manager",
        "jaxinfer.sampling_params",
        "jaxinfer.prompts",
        "jaxinfer.serve.app",
        "jaxinfer.serve.client",
        "jaxinfer.serve.core",
        "jaxinfer.serve.__main__",
        "jaxinfer.cli_args",
        "jaxinfer.engine.structured",
        "jaxinfer.spec.ngram",
        "jaxinfer.lora.request",
        "jaxinfer.lora.peft",
        "jaxinfer.engine.lora",
    ]
    code = (
        f"import sys, {', '.join(host)}; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'jaxlib', 'flax'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# Each folder of `jaxinfer` with the folders and top-level modules it may import at module level
# (the layers of docs/layout.md, lower ones first); anything else is an arrow back up.
SHARED = {
    "jaxinfer.checks",
    "jaxinfer.sampling_params",
    "jaxinfer.step_input",
    "jaxinfer.stats",
    "jaxinfer.outputs",
}
ALLOWED = {
    "jaxinfer.config": {"jaxinfer.config"} | SHARED,
    "jaxinfer.models": {"jaxinfer.config", "jaxinfer.models"} | SHARED,
    "jaxinfer.runner": {"jaxinfer.config", "jaxinfer.models", "jaxinfer.runner", "jaxinfer.lora"}
    | SHARED,
    "jaxinfer.spec": {"jaxinfer.spec"} | SHARED,
    "jaxinfer.engine": {"jaxinfer.config", "jaxinfer.spec", "jaxinfer.engine", "jaxinfer.lora"}
    | SHARED,
    "jaxinfer.lora": {"jaxinfer.lora"} | SHARED,
}


def _folder(module: str) -> str:
    return ".".join(module.split(".")[:2])


def test_no_import_goes_back_up():
    """The host engine imports neither the runner nor the models (it reaches the device only
    through the runner it is given), the models import no runner, config imports neither."""
    modules = _modules()
    arrows = [
        f"{m} -> {d}"
        for m, p in modules.items()
        if _folder(m) in ALLOWED
        for d in _edges(m, p, modules)
        if d.startswith("jaxinfer.") and _folder(d) not in ALLOWED[_folder(m)]
    ]
    assert arrows == []
