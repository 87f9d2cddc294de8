"""Structured output speed: decode step time with every row under a JSON schema vs unconstrained,
and the host's mask time per step.

Runs `LLMEngine` on random weights (``--arch qwen3-8b``: the Qwen3-8B architecture with
``--layers`` layers, bf16; ``tiny``: a 2-layer model for a CPU check) over SmolLM2's tokenizer
(the grammars' vocabulary; ids past it are never allowed), ``--batch`` requests of ``--context``
tokens in steady decode, ``ignore_eos`` so that no row ends:

  free   no constraint: asynchronous scheduling overlaps the host with the device
  json   every row under a schema of `SCHEMAS` (``--schemas``; an unbounded array of records, so
         no grammar completes):
         each step runs as a forward dispatched before the previous step is read back, then a
         sampling call once the host has filled B bitmask rows (`jaxinfer.engine.structured`);
         ``overlapped``: the fraction of timed steps dispatched with one in flight (1.0 expected)

and, apart from the engine, ``mask``: `StructuredOutputManager.fill` of B rows per step (the
engine's call, llguidance's thread pool) replaying B valid documents of the schema token by token
(p50, p99, mean ms per step). Ratio = json / free step time (issue 30: <= 1.10 on the H200).
Appends JSON objects (bench="structured") to ``--out`` and prints a table.

    python scripts/bench_structured.py [--arch qwen3-8b] [--layers 36] [--batch 64]
        [--context 1024] [--steps 50] [--out benchmarks/h200.jsonl]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.run_info import git_commit, xla_flags  # noqa: E402

RECORD = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
    },
}
PLAIN = dict(RECORD, properties=dict(RECORD["properties"], name={"type": "string"}))
SCHEMAS = {
    "bounded": {"type": "array", "items": RECORD},  # the name's maxLength: llguidance
    "plain": {"type": "array", "items": PLAIN},
}  # counts characters in the string
TINY = dict(
    architecture="qwen3",
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)


def mask_times(manager, tokenizer, batch: int, schema: dict) -> np.ndarray:
    """Seconds of each step's `fill` of ``batch`` rows replaying valid documents of ``schema``."""
    from jaxinfer.engine.sequence import Sequence
    from jaxinfer.sampling_params import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=schema)
    docs = [
        tokenizer.encode(
            json.dumps(
                [
                    {
                        "name": f"Name{i}{j}",
                        "age": (i * 7 + j) % 150,
                        "tags": ["red", "blue"][: 1 + (i + j) % 2],
                    }
                    for j in range(8)
                ]
            ),
            add_special_tokens=False,
        )
        for i in range(batch)
    ]
    matchers = [manager.matcher(so) for _ in docs]
    rows = [
        (i, Sequence(str(i), [0], SamplingParams(), 0, matcher=m)) for i, m in enumerate(matchers)
    ]
    bitmask = np.full((batch, manager.words), -1, np.int32)
    times = []
    for t in range(min(map(len, docs))):
        t0 = time.perf_counter()
        manager.fill(bitmask, rows)
        times.append(time.perf_counter() - t0)
        for i, (doc, m) in enumerate(zip(docs, matchers)):
            assert bitmask[i, doc[t] // 32] >> (doc[t] % 32) & 1, "a valid token masked out"
            manager.accept(m, doc[t])
    assert not any(m.is_error() for m in matchers)
    return np.array(times)


def step_time(eng, so, args) -> tuple[float, float]:
    """Mean wall seconds of `LLMEngine.step` in steady decode of ``args.batch`` rows, and the
    fraction of those steps launched while the previous one was in flight. Outputs are
    FINAL_ONLY, as `LLM.generate` asks (no per-step `RequestOutput`s)."""
    from jaxinfer.sampling_params import RequestOutputKind, SamplingParams

    rng, warm = np.random.default_rng(0), 8
    for _ in range(args.batch):
        eng.add_request(
            rng.integers(100, 10000, args.context - warm - args.steps - 4).tolist(),
            SamplingParams(
                temperature=0.0,
                max_tokens=warm + args.steps + 2,
                ignore_eos=True,
                structured_outputs=so,
                output_kind=RequestOutputKind.FINAL_ONLY,
            ),
        )
    while eng.scheduler.num_waiting or eng.scheduler.prefilling is not None:
        eng.step()
    for _ in range(warm):  # compile and warm the decode shape
        eng.step()
    t, overlapped = time.perf_counter(), eng.stats().num_overlapped_steps
    for _ in range(args.steps):
        eng.step()
    dt = (time.perf_counter() - t) / args.steps
    overlapped = (eng.stats().num_overlapped_steps - overlapped) / args.steps
    eng.abort_all()
    return dt, overlapped


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=("qwen3-8b", "tiny"), default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=36, help="qwen3-8b layers")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024, help="KV length reached at the end")
    ap.add_argument("--steps", type=int, default=50, help="timed steps per mode")
    ap.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="an HF tokenizer directory saved from SmolLM2's (default: read the GGUF)",
    )
    ap.add_argument("--schemas", nargs="+", choices=sorted(SCHEMAS), default=sorted(SCHEMAS))
    ap.add_argument(
        "--out",
        default=None,
        help="default: benchmarks/h200.jsonl on a GPU, else benchmarks/cpu.jsonl",
    )
    return ap


def build_engine(args, tok):
    """An `LLMEngine` over random weights of ``args.arch`` (bf16 on a GPU, else float32) whose
    pool holds ``args.batch`` rows of ``args.context`` tokens; grammars over ``tok``."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import models
    from jaxinfer.config import EngineConfig, ModelConfig, resolve
    from jaxinfer.engine.llm_engine import LLMEngine
    from jaxinfer.runner.model_runner import ModelRunner
    from scripts.decode_step import QWEN3_8B

    arch = (
        dict(QWEN3_8B, num_layers=args.layers)
        if args.arch == "qwen3-8b"
        else dict(TINY, vocab_size=len(tok))
    )
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    cfg = ModelConfig(**arch)
    params = models.init_params(cfg, jax.random.key(0), jnp.dtype(dtype))
    B, ps = args.batch, 16
    ec = EngineConfig(
        max_model_len=args.context,
        page_size=ps,
        dtype=dtype,
        max_num_seqs=B,
        num_pages=B * -(-args.context // ps) + 1,
        max_num_batched_tokens=max(2048, args.context),
    )
    return LLMEngine(
        ModelRunner(cfg, params, resolve(cfg, ec, jax.default_backend())),
        eos_token_ids=(tok.eos_token_id,),
        tokenizer=tok,
    )


def schema_rows(eng, tok, args, meta: dict, t_free: float) -> list[dict]:
    """Per schema: the constrained step time ("json") and the host's mask time ("mask")."""
    from jaxinfer.sampling_params import StructuredOutputsParams

    rows = []
    for name in args.schemas:
        t_json, o_json = step_time(eng, StructuredOutputsParams(json=SCHEMAS[name]), args)
        mask = mask_times(eng.structured, tok, args.batch, SCHEMAS[name])
        rows += [
            dict(
                meta,
                mode="json",
                schema=name,
                ms_per_step=t_json * 1e3,
                ratio=t_json / t_free,
                overlapped=o_json,
            ),
            dict(
                meta,
                mode="mask",
                schema=name,
                ms_per_step=float(mask.mean() * 1e3),
                p50_ms=float(np.percentile(mask, 50) * 1e3),
                p99_ms=float(np.percentile(mask, 99) * 1e3),
                steps=len(mask),
            ),
        ]
    return rows


def print_rows(rows: list[dict], args, meta: dict) -> None:
    print(
        f"\n{args.arch} layers={meta['layers']} B={args.batch} context={args.context} "
        f"V={meta['vocab']} device={meta['device']}"
    )
    print(f"{'mode':<14} {'ms/step':>9} {'ratio':>7} {'p50 ms':>8} {'p99 ms':>8} {'overlap':>8}")
    nan = float("nan")
    for r in rows:
        print(
            f"{r['mode'] + ' ' + r.get('schema', ''):<14} {r['ms_per_step']:>9.3f} "
            f"{r.get('ratio', nan):>7.3f} {r.get('p50_ms', nan):>8.3f} "
            f"{r.get('p99_ms', nan):>8.3f} {r.get('overlapped', nan):>8.2f}"
        )


def main() -> None:
    args = parser().parse_args()
    import jax

    from checkpoints_tools.default_model import default_model_path
    from checkpoints_tools.loader import load_tokenizer

    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tok = load_tokenizer(default_model_path(), "gguf")
    eng = build_engine(args, tok)
    t_free, o_free = step_time(eng, None, args)
    cfg = eng.model_config
    meta = dict(
        bench="structured",
        arch=args.arch,
        layers=cfg.num_layers,
        B=args.batch,
        context=args.context,
        vocab=cfg.vocab_size,
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
        cpus=os.cpu_count(),
        date=datetime.date.today().isoformat(),
        commit=git_commit(),
        xla_flags=xla_flags(),
    )
    rows = [dict(meta, mode="free", ms_per_step=t_free * 1e3, overlapped=o_free)]
    rows += schema_rows(eng, tok, args, meta, t_free)
    out = args.out or f"benchmarks/{'h200' if jax.default_backend() == 'gpu' else 'cpu'}.jsonl"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "a") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    print_rows(rows, args, meta)


if __name__ == "__main__":
    main()
