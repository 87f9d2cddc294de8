"""Transitional re-export while callers move to `jaxinfer.models` (removed before the merge)."""
from jaxinfer.models.layers import Packing, apply_rope, rms_norm  # noqa: F401
