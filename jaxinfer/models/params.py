"""Transitional re-export while callers move to `jaxinfer.models` (removed before the merge)."""
from jaxinfer.models import abstract_params, fused_parts, param_bytes  # noqa: F401
