"""THE weight table: each leaf of the param tree once, `MODEL` at the top, `LAYER` under layers/
"0".."L-1" (a layer's leaves: `layer_leaves`; MoE models: sparse layers have the router and
the experts, dense ones the MLP); matrices [in, out], compute dtype (norms too); under "fp8" a
`QUANTIZED` matrix is float8_e4m3fn with an f32 ``<name>_scale`` (`scale_shape`), stored K-major
[out, in] where its scales are per channel (`kmajor`). The Flax modules (`layers.declare`),
shardings (`entries`) and sizes (`device_bytes`) read it. Imports no JAX."""

import math
from collections.abc import Callable
from typing import Any, NamedTuple

from jaxinfer.config.model import tp_model_config

INIT_STD = 0.02  # HF ``initializer_range`` default: N(0, 0.02) for matrices and the embedding.


class Leaf(NamedTuple):
    """``shape``: per axis an expression of V, D, N, K, H, F, E, F_e (`shape_of`); ``split``: the
    axis tensor parallelism splits, "column" (out), "row" (in), "vocab" (V, if tp divides V) or
    None; ``init``: "normal" N(0, `INIT_STD`) or "ones"; ``fp8``: quantisable; ``when``: cfg ->
    has it; ``mlp``: a layer leaf only on "dense" or "sparse" layers (`ModelConfig.is_sparse`)."""

    shape: tuple[str, ...]
    split: str | None
    init: str = "normal"
    fp8: bool = False
    when: Callable[[Any], bool] = lambda cfg: True
    mlp: str | None = None


MODEL = {
    "embed": Leaf(("V", "D"), "vocab"),
    "lm_head": Leaf(("D", "V"), "vocab", when=lambda cfg: not cfg.tie_word_embeddings),
    "final_norm": Leaf(("D",), None, "ones"),
}
LAYER = {
    "attn_norm": Leaf(("D",), None, "ones"),
    "wqkv": Leaf(("D", "(N + 2 * K) * H"), "column", fp8=True),  # q | k | v: `fused_parts`
    "wo": Leaf(("N * H", "D"), "row", fp8=True),
    "q_norm": Leaf(("H",), None, "ones", when=lambda cfg: cfg.qk_norm),
    "k_norm": Leaf(("H",), None, "ones", when=lambda cfg: cfg.qk_norm),
    "mlp_norm": Leaf(("D",), None, "ones"),
    "w_gate_up": Leaf(("D", "2 * F"), "column", fp8=True, mlp="dense"),  # gate | up
    "w_down": Leaf(("F", "D"), "row", fp8=True, mlp="dense"),
    "router": Leaf(("D", "E"), None, mlp="sparse"),
    "w_experts_gate_up": Leaf(("E", "D", "2 * F_e"), "column", fp8=True, mlp="sparse"),  # gate|up
    "w_experts_down": Leaf(("E", "F_e", "D"), "row", fp8=True, mlp="sparse"),
}
LEAVES = {**MODEL, **LAYER}
QUANTIZED = tuple(n for n, leaf in LAYER.items() if leaf.fp8 and leaf.mlp != "sparse")  # dense


def layer_leaves(cfg, layer: int) -> tuple[str, ...]:
    """The `LAYER` leaves layer ``layer`` of ``cfg`` has (``when``; ``mlp`` by `is_sparse`)."""
    kind = "sparse" if cfg.is_sparse(layer) else "dense"
    return tuple(n for n, f in LAYER.items() if f.when(cfg) and f.mlp in (None, kind))


def shape_of(name: str, cfg) -> tuple[int, ...]:
    """Leaf ``name``'s shape for ``cfg``: V, D, N, K, H, F, E, F_e = vocab_size, hidden_size,
    num_heads, num_kv_heads, head_dim, intermediate_size, num_experts, moe_intermediate_size."""
    letters = dict(
        E=cfg.num_experts,
        F_e=cfg.moe_intermediate_size,
        V=cfg.vocab_size,
        D=cfg.hidden_size,
        N=cfg.num_heads,
        K=cfg.num_kv_heads,
        H=cfg.head_dim,
        F=cfg.intermediate_size,
    )
    return tuple(eval(e, {"__builtins__": {}}, letters) for e in LEAVES[name].shape)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, ...]:
    """Shape of the f32 scale of an fp8 matrix of `shape_of` ``shape`` [in, out] (or a stack
    [E, in, out]; whatever layout it is stored in, `kmajor`): per output channel [out] ([E, out])
    (``block`` None), or per HF block ``(block_out, block_in)``: [ceil(in/bi), ceil(out/bo)]
    ([E, ceil(in/bi), ceil(out/bo)]: each expert's HF ``weight_scale_inv`` transposed)."""
    if block is None:
        return (*shape[:-2], shape[-1])
    return (*shape[:-2], -(-shape[-2] // block[1]), -(-shape[-1] // block[0]))


def kmajor(name: str, block: tuple[int, int] | None) -> bool:
    """Whether leaf ``name``, quantised to fp8 with ``block`` (``weight_block_size``), is stored
    K-major: [out, in], the transpose of `shape_of`'s [in, out]. True for the dense layers'
    matrices (`QUANTIZED`) with per-channel scales (``block`` None): cuBLASLt's fp8 GEMM wants
    both operands contiguous in K, and XLA otherwise transposes an [in, out] weight on every call
    (the H100 timings: ``BENCHMARKS.md``). HF block-scaled matrices keep the checkpoint's
    [in, out] and MoE expert stacks [E, in, out] (the grouped GEMMs' contract,
    `moe.grouped_dense`)."""
    return block is None and name in QUANTIZED


def stored_shape(name: str, shape: tuple[int, ...], block, fp8: bool) -> tuple[int, ...]:
    """Leaf ``name``'s ``shape`` (`shape_of`'s) as stored: last two axes swapped where it is fp8
    (``fp8``) and `kmajor`."""
    return (*shape[:-2], shape[-1], shape[-2]) if fp8 and kmajor(name, block) else tuple(shape)


def fused_parts(cfg) -> dict[str, dict[str, slice]]:
    """Slices of each projection on the output (last) axis of the fused matrices: ``{"wqkv": {"q":
    [0, N*H), "k": [N*H, (N+K)*H), "v": [(N+K)*H, (N+2K)*H)}, "w_gate_up": {"gate": [0, F), "up":
    [F, 2F)}}`` (the tensor-parallel layout: `jaxinfer.runner.parallel.engine_layout`); MoE also
    ``"w_experts_gate_up": {"gate": [0, F_e), "up": [F_e, 2F_e)}``."""
    N, K, F, H = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, cfg.head_dim
    Fe = cfg.moe_intermediate_size
    moe = {"w_experts_gate_up": {"gate": slice(0, Fe), "up": slice(Fe, 2 * Fe)}}
    return (moe if cfg.num_experts else {}) | {
        "wqkv": {
            "q": slice(0, N * H),
            "k": slice(N * H, (N + K) * H),
            "v": slice((N + K) * H, (N + 2 * K) * H),
        },
        "w_gate_up": {"gate": slice(0, F), "up": slice(F, 2 * F)},
    }


def entries(cfg, tp: int = 1, quantization: str | None = None) -> list[tuple]:
    """``(path, shape, dtype, split)`` of each leaf of ``cfg``'s tree at tensor parallelism ``tp``:
    tree path, whole shape as stored (of `tp_model_config`: K' = max(K, tp); `stored_shape`:
    K-major fp8 [out, in]), "compute", "float8_e4m3fn" or "float32", the axis tp splits (None:
    whole on each device; "out" of a K-major matrix is its first axis); ``quantization`` None or
    "fp8" (``cfg.weight_block_size``): scales split as their matrix, those per channel of rows
    not."""
    run, block, out = tp_model_config(cfg, tp), cfg.weight_block_size, []
    for name, leaf in ((n, f) for n, f in LEAVES.items() if f.when(cfg)):
        shape, fp8 = shape_of(name, run), quantization == "fp8" and leaf.fp8
        cut = (  # the split axis of the [in, out] layout
            None
            if leaf.split is None or leaf.split == "vocab" and cfg.vocab_size % tp
            else leaf.shape.index("V")
            if leaf.split == "vocab"
            else len(leaf.shape) - (1 if leaf.split == "column" else 2)  # out / in
        )
        swap = fp8 and kmajor(name, block) and cut is not None  # K-major: in <-> out
        axis = 2 * len(shape) - 3 - cut if swap else cut
        dtype = "float8_e4m3fn" if fp8 else "compute"
        leaves = [(name, stored_shape(name, shape, block, fp8), dtype, axis)]
        if fp8:
            leaves.append(
                (
                    name + "_scale",
                    scale_shape(shape, block),
                    "float32",
                    cut if block else cut - 1 if leaf.split == "column" else None,
                )
            )
        layers = (
            [("layers", str(i)) for i in range(cfg.num_layers) if name in layer_leaves(cfg, i)]
            if name in LAYER
            else [()]
        )
        out += [((*at, n), *rest) for at in layers for n, *rest in leaves]
    return out


def device_bytes(cfg, tp: int = 1, compute_bytes: int = 1, quantization: str | None = None) -> int:
    """Bytes one device of ``tp`` holds of the tree (`entries`): ``compute_bytes`` per compute-dtype
    element, fp8 1, scales 4 (``compute_bytes`` 1, unquantised: the parameter count)."""
    size = {"compute": compute_bytes, "float8_e4m3fn": 1, "float32": 4}
    return sum(
        math.prod(shape) // (1 if split is None else tp) * size[dtype]
        for _, shape, dtype, split in entries(cfg, tp, quantization)
    )
