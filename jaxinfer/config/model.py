"""`ModelConfig`, the architecture of a Llama / Qwen3 / Qwen3-MoE decoder (from HF
``config.json``, GGUF metadata or a saved dict), and its tensor-parallel form (`check_tp`,
`tp_model_config`). A bad value raises ValueError naming the field,
the value and what is allowed. Imports no JAX."""

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from checkpoints_tools.mapping import fp8_block_size
from jaxinfer.checks import is_int

SUPPORTED_ARCHITECTURES = ("llama", "qwen3", "qwen3_moe")
MOE_ARCHITECTURES = ("qwen3_moe",)
SUPPORTED_ROPE_TYPES = ("default", "llama3")


def _fail(cls: str, name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{cls}.{name}={value!r} is invalid: {allowed}")


def _check(obj, rules: Iterable[tuple[str, Callable[[Any], bool], str]]) -> None:
    for name, ok, allowed in rules:
        if not ok(getattr(obj, name)):
            _fail(type(obj).__name__, name, getattr(obj, name), allowed)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 RoPE frequency scaling (HF ``rope_type: llama3``, ``_compute_llama3_parameters``)."""

    rope_type: str = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        _check(
            self,
            (
                ("rope_type", lambda v: v == "llama3", "only 'llama3' scaling is supported"),
                ("factor", lambda v: v > 0, "must be > 0"),
                (
                    "high_freq_factor",
                    lambda v: 0 < self.low_freq_factor < v,
                    f"need 0 < low_freq_factor ({self.low_freq_factor}) < high_freq_factor",
                ),
                ("original_max_position_embeddings", lambda v: v >= 1, "must be >= 1"),
            ),
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama / Qwen3 / Qwen3-MoE decoder; shape letters: V, D, F (intermediate), L, N, K, H,
    G = N/K; MoE (qwen3_moe, HF ``Qwen3MoeConfig``): E = ``num_experts``, top-k =
    ``num_experts_per_tok``, F_e = ``moe_intermediate_size``; layer i is sparse (`is_sparse`) unless
    in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``; dense layers have an MLP of F."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    weight_block_size: tuple[int, int] | None = None  # an HF FP8 checkpoint's (block_out, block_in)
    num_experts: int = 0  # E; 0: every layer dense
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # F_e
    norm_topk_prob: bool = False  # the top-k probabilities renormalised to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check(
            self,
            (
                (
                    "architecture",
                    SUPPORTED_ARCHITECTURES.__contains__,
                    f"supported architectures are {SUPPORTED_ARCHITECTURES}",
                ),
                *(
                    (n, lambda v: is_int(v, 1), "must be a positive integer")
                    for n in (
                        "vocab_size",
                        "hidden_size",
                        "intermediate_size",
                        "num_layers",
                        "num_heads",
                        "num_kv_heads",
                        "head_dim",
                        "max_position_embeddings",
                    )
                ),
                (
                    "num_kv_heads",
                    lambda v: self.num_heads % v == 0,
                    f"must divide num_heads={self.num_heads} (GQA)",
                ),
                ("head_dim", lambda v: v % 2 == 0, "must be even (RoPE rotates pairs)"),
                ("rms_norm_eps", lambda v: v > 0, "must be > 0"),
                ("rope_theta", lambda v: v > 0, "must be > 0"),
                (
                    "weight_block_size",
                    lambda v: v is None or len(v) == 2,
                    "None or (out, in) sizes",
                ),
            ),
        )
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        _check(self, _moe_rules(self))
        object.__setattr__(
            self,
            "weight_block_size",
            self.weight_block_size and tuple(int(b) for b in self.weight_block_size),
        )

    qk_norm = property(
        lambda self: self.architecture in ("qwen3", "qwen3_moe"),
        doc="Qwen3 applies a per-head RMSNorm to q and k before RoPE.",
    )

    def is_sparse(self, layer: int) -> bool:
        """Whether layer ``layer`` has the MoE MLP (HF ``Qwen3MoeDecoderLayer``'s rule)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """2 (K and V) x L x K x H x dtype_bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> "ModelConfig":
        """From a parsed HF ``config.json`` (transformers 4.x or 5.x). Raises ValueError: an
        unsupported model_type, RoPE type, bias, sliding window or activation; a missing key."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture: model_type={model_type!r} (architectures="
                f"{cfg.get('architectures') or []}); supported model_type values are "
                f"{SUPPORTED_ARCHITECTURES}"
            )
        for key in ("attention_bias", "mlp_bias", "use_sliding_window"):
            if cfg.get(key):
                raise ValueError(f"{model_type} with {key}=True is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg['hidden_act']!r} is not supported; only 'silu'")
        rope = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}  # 5; 4.x
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported RoPE type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}"
            )
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        try:
            scaling = (
                None
                if rope_type != "llama3"
                else RopeScaling(
                    factor=float(rope["factor"]),
                    low_freq_factor=float(rope["low_freq_factor"]),
                    high_freq_factor=float(rope["high_freq_factor"]),
                    original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                )
            )
            n = int(cfg["num_attention_heads"])
            return cls(
                architecture=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=int(cfg["hidden_size"]),
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=n,
                num_kv_heads=int(cfg.get("num_key_value_heads") or n),
                head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_scaling=scaling,
                rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos,
                weight_block_size=fp8_block_size(cfg.get("quantization_config")),
                **(_moe_fields(cfg) if model_type in MOE_ARCHITECTURES else {}),
            )
        except KeyError as e:
            raise ValueError(
                f"config.json lacks the required key {e.args[0]!r} (model_type={model_type!r})"
            ) from None

    @classmethod
    def from_checkpoint(cls, ckpt) -> "ModelConfig":
        """From a checkpoint's config, no tensors read: an opened
        `checkpoints_tools.loader.Checkpoint`, or a path (`detect_format`). FileNotFoundError (a
        needed file, named); ValueError: unsupported format or config (`from_hf_config`)."""
        from checkpoints_tools.loader import Checkpoint, open_checkpoint

        ckpt = ckpt if isinstance(ckpt, Checkpoint) else open_checkpoint(ckpt)
        return (cls.from_dict if ckpt.format == "orbax" else cls.from_hf_config)(ckpt.config)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        rope = d.get("rope_scaling")
        return cls(**{**d, "rope_scaling": rope and RopeScaling(**rope)})


def _moe_rules(m: ModelConfig) -> tuple:
    """`_check` rules of the MoE fields: E > 0 only for `MOE_ARCHITECTURES`; then 1 <= top-k <=
    E, F_e >= 1; decoder_sparse_step >= 1; mlp_only_layers in [0, L)."""
    moe, E = m.architecture in MOE_ARCHITECTURES, m.num_experts
    return (
        (
            "num_experts",
            lambda v: is_int(v, 0) and (moe or v == 0),
            f"must be an integer >= 0, and 0 unless architecture is in {MOE_ARCHITECTURES}",
        ),
        (
            "num_experts_per_tok",
            lambda v: E == 0 or is_int(v, 1) and v <= E,
            f"must be in [1, num_experts={E}]",
        ),
        ("moe_intermediate_size", lambda v: E == 0 or is_int(v, 1), "must be a positive integer"),
        ("decoder_sparse_step", lambda v: is_int(v, 1), "must be a positive integer"),
        (
            "mlp_only_layers",
            lambda v: all(0 <= i < m.num_layers for i in v),
            f"layer indices must be in [0, num_layers={m.num_layers})",
        ),
    )


def _moe_fields(cfg: Mapping[str, Any]) -> dict:
    """The MoE fields of an HF ``Qwen3MoeConfig`` dict (E: ``num_experts``, or transformers 5's
    ``num_local_experts``)."""
    return dict(
        num_experts=int(cfg.get("num_experts", cfg.get("num_local_experts", 0))),
        num_experts_per_tok=int(cfg["num_experts_per_tok"]),
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
    )


def check_tp(model: ModelConfig, tp: int) -> None:
    """Raise ValueError naming the numbers unless tensor parallelism of degree ``tp`` splits
    ``model``: tp divides N, F and F_e (MoE: each expert split), and K % tp == 0 or tp % K == 0
    (KV heads replicated); at tp > 1 an FP8 checkpoint's blocks ``weight_block_size`` (bo, bi)
    whole on each device: bo divides its q, k, v, gate, up columns (N*H/tp, K'*H/tp, F/tp), bi
    its wo, w_down rows (N*H/tp, F/tp); MoE: both divide each expert's share F_e/tp (its gate,
    up columns and down rows; vLLM refuses the same splits)."""
    for name in ("num_heads", "intermediate_size", "moe_intermediate_size"):
        if getattr(model, name) % tp:
            raise ValueError(
                f"{name}={getattr(model, name)} is not divisible by tensor_parallel_size={tp}"
            )
    if (K := model.num_kv_heads) % tp and tp % K:
        raise ValueError(
            f"num_kv_heads={K} and tensor_parallel_size={tp}: one must divide the "
            "other (tp > K replicates the KV heads)"
        )
    if tp > 1 and (block := model.weight_block_size):
        H, F = model.head_dim, model.intermediate_size // tp
        NH, KH = model.num_heads * H // tp, max(K, tp) * H // tp
        if NH % block[0] or KH % block[0] or F % block[0] or NH % block[1] or F % block[1]:
            raise ValueError(
                f"weight_block_size={block} and tensor_parallel_size={tp}: each "
                "device needs whole FP8 blocks (block_out, block_in) in its q columns "
                f"and wo rows N*H/tp={NH}, k, v columns K'*H/tp={KH}, gate, up "
                f"columns and w_down rows F/tp={F}"
            )
        if (Fe := model.moe_intermediate_size // tp) % block[0] or Fe % block[1]:
            raise ValueError(
                f"weight_block_size={block} and tensor_parallel_size={tp}: each device needs "
                f"whole FP8 blocks (block_out, block_in) in its share of each expert's gate, up "
                f"columns and down rows moe_intermediate_size/tp={Fe}; use a "
                "tensor_parallel_size that leaves whole blocks"
            )


def tp_model_config(model: ModelConfig, tp: int) -> ModelConfig:
    """Config at tensor parallelism ``tp``: K' = max(K, tp), shard s copying KV head s*K//tp."""
    return dataclasses.replace(model, num_kv_heads=max(model.num_kv_heads, tp))
