"""Transitional re-export while callers move to `jaxinfer.models` (removed before the merge)."""
from jaxinfer.models import (Packing, abstract_params, check_params, compute_logits,  # noqa: F401
                             forward, fused_parts, init_params, param_bytes)
