"""Accuracy of the fp8 settings (KV cache, weights, both, W8A8: weights and activations, W8A8
with fp8 KV) on SmolLM2-135M-Instruct (real weights, CPU, float32 compute), each against the
unquantised baseline of the same run:

  perplexity  of the first ``--tokens`` tokens of the Python documentation that ships with the
              standard library (`pydoc_data.topics.topics`, values joined in sorted key order),
              teacher-forced as one sequence through `jaxinfer.models.forward` over the paged
              cache in chunks of ``--chunk`` tokens, each chunk's K/V appended to the cache and
              read back (so fp8 pages are what attention reads).
  agreement   greedy decoding of ``--prompts`` prompts (the first ``--prompt-len`` tokens of
              topics spread over the text) x ``--gen-tokens`` tokens through `LLM.generate`
              (EOS ignored): the fraction of positions equal to the baseline's up to the first
              divergence, averaged over prompts.

``--smoothquant ALPHA`` (default: the engine's, 0.4; 0: off) runs the ``--smooth-settings`` rows
(default: w8a8, w8a8+kv, where the engine smooths by default) on SmoothQuant-folded weights
(`jaxinfer.models.smoothquant.smooth_params` over the engine's calibration text, held out), as
the engine serves them; their fp8 KV means come from the folded model.

``--kv-scales one`` keeps the cache's scales at 1.0 (`jaxinfer.models.kv_cache.KVCache`);
``calibrated`` sets them to ``amax x --margin / 448`` per layer and KV head of the baseline's K
and V over the first chunk (start-up calibration on the first prefill). Prints a table and
appends one JSON line per setting (baseline included) to ``--out``.

``--kv-smooth`` gives the engine's fp8 KV rows (kv, both) the means per layer and KV head of
the baseline's post-RoPE K and of V over the first chunk (`KVCache.k_mean`, ``v_mean``), as
"smooth" below; ``--kv-smooth calibration``: the means the engine itself sets
(`EngineConfig.calculate_kv_scales`: `kv_means` over `calibration_ids`, text held out from the
one measured). ``--jitter N`` adds N perplexity rows of the engine's fp8 KV with 1e-3 x N(0, 1)
added to the means: the spread of fp8 rounding noise (a few values rounded the other way early
on change many later ones). ``--kv-sim`` adds perplexity-only rows of fp8 KV methods the
engine lacks, simulated on float32 pools by an attention (`simulated_attention`) that reads
every page as fp8 pages would give it back (`pallas_kernels.kv_quant.quantize`, then times the
scale), except where a method says otherwise; each method is "+"-joined parts ("fp8" alone: none,
the engine's fp8 KV re-derived):
  chunk    the current chunk's K/V exact, only the earlier pages fp8 (vLLM's / SGLang's prefill
           attends the chunk's own K/V before they are read back from the cache);
  smooth   pages hold ``k - m_k`` and ``v - m_v``, m the mean per layer and KV head of the
           post-RoPE K and of V over the first chunk (SageAttention's K smoothing, arXiv
           2410.02367: softmax(q.(k - m)) = softmax(q.k); the V mean comes back as a sum of
           probabilities 1, so both are exact before rounding); ``smoothk``: K only;
  weights  fp8 weights as the "weights" setting.

    python scripts/eval_accuracy.py [--settings kv weights both w8a8 w8a8+kv]
                                    [--kv-scales one|calibrated]
                                    [--kv-smooth] [--perplexity-only]
                                    [--smoothquant ALPHA] [--smooth-settings NAME ...]
                                    [--kv-sim fp8 chunk smooth chunk+smooth smooth+weights]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxinfer.config import KV_CACHE_DTYPES  # noqa: E402
from jaxinfer.config.resolved import DEFAULT_SMOOTHQUANT  # noqa: E402
from jaxinfer.engine.llm_engine import calibration_ids  # noqa: E402
from jaxinfer.models.kernels import ModelKernels  # noqa: E402
from jaxinfer.models.quantize import quantize_params  # noqa: E402
from jaxinfer.models.smoothquant import smooth_params  # noqa: E402
from jaxinfer.runner.model_runner import kv_means  # noqa: E402
from scripts.kv_eval import (  # noqa: E402
    PAGE_SIZE,
    agreement,
    calibrated_scales,
    first_chunk_kv,
    first_chunk_means,
    greedy,
    jittered,
    simulated_attention,
    teacher_forced,
)
from scripts.run_info import git_commit  # noqa: E402

SIM_PARTS = ("fp8", "chunk", "smooth", "smoothk", "weights")


def corpus_text() -> str:
    """The standard library's pydoc topics, values joined in sorted key order."""
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))


def prompt_ids(tokenizer, n: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens of ``n`` topics evenly spread over the sorted keys."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    picks = [keys[i * len(keys) // n] for i in range(n)]
    return [tokenizer.encode(topics[k][: 8 * length])[:length] for k in picks]


def simulated(params, cfg, ids, args, method: str, first) -> dict:
    """The perplexity row of ``--kv-sim`` ``method`` (`simulated_attention`); ``first``:
    `first_chunk_kv`, for the means and calibrated scales."""
    parts = set(method.split("+"))
    k_mean, v_mean = first_chunk_means(
        first, bool(parts & {"smooth", "smoothk"}), "smooth" in parts
    )
    scales = (
        calibrated_scales(first, args.margin, (k_mean, v_mean))
        if args.kv_scales == "calibrated"
        else (jnp.ones(k_mean.shape[:2]),) * 2
    )
    kernels = ModelKernels(simulated_attention("chunk" in parts, *scales, k_mean, v_mean))
    quant = "fp8" if "weights" in parts else None
    t = time.perf_counter()
    nll, _ = teacher_forced(
        params if quant is None else quantize_params(params, None),
        cfg,
        ids,
        args.chunk,
        jnp.float32,
        kernels=kernels,
    )
    print(
        f"sim {method}: perplexity {np.exp(nll):.4f} in {time.perf_counter() - t:.0f} s",
        file=sys.stderr,
    )
    return dict(
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=quant,
        kv_scales=args.kv_scales,
        kv_method=method,
        ppl=float(np.exp(nll)),
        gen=None,
        seconds=time.perf_counter() - t,
    )


def add_smoothquant_args(p: argparse.ArgumentParser) -> None:
    """``--smoothquant ALPHA`` and ``--smooth-settings NAME ...`` (`smoothed_settings`)."""
    p.add_argument(
        "--smoothquant",
        type=float,
        default=DEFAULT_SMOOTHQUANT,
        metavar="ALPHA",
        help="SmoothQuant alpha of the --smooth-settings rows, calibrated as the engine does "
        "(0: off)",
    )
    p.add_argument(
        "--smooth-settings",
        nargs="*",
        choices=("weights", "both", "w8a8", "w8a8+kv"),
        default=["w8a8", "w8a8+kv"],
        help="the settings --smoothquant applies to (default: the W8A8 ones, as the engine)",
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the embedded SmolLM2)")
    p.add_argument(
        "--kv-cache-dtype", choices=[k for k in KV_CACHE_DTYPES if k != "auto"], default="fp8"
    )
    p.add_argument(
        "--settings",
        nargs="*",
        choices=("kv", "weights", "both", "w8a8", "w8a8+kv"),
        default=["kv", "weights", "both", "w8a8", "w8a8+kv"],
        help="besides the baseline: fp8 KV, fp8 weights, both, W8A8 (fp8 activations too), "
        "W8A8 and fp8 KV",
    )
    p.add_argument("--kv-scales", choices=("one", "calibrated"), default="one")
    p.add_argument(
        "--kv-smooth",
        nargs="?",
        const="first-chunk",
        default=None,
        choices=("first-chunk", "calibration"),
        help="the engine's fp8 KV rows with K and V means of the first chunk, or of "
        "the engine's own calibration text (held out)",
    )
    p.add_argument(
        "--jitter",
        type=int,
        default=0,
        metavar="N",
        help="perplexity only: N more fp8 KV rows, means + 1e-3 noise (seeds 1..N)",
    )
    p.add_argument(
        "--kv-sim",
        nargs="*",
        default=[],
        metavar="METHOD",
        help=f"perplexity only: fp8 KV simulated, '+'-joined parts of {SIM_PARTS}",
    )
    add_smoothquant_args(p)
    p.add_argument("--margin", type=float, default=1.25, help="calibrated scales' headroom")
    p.add_argument("--perplexity-only", action="store_true", help="no greedy decoding")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-tokens", type=int, default=64)
    p.add_argument("--out", default="benchmarks/accuracy.jsonl")
    args = p.parse_args(argv)
    for name in ("tokens", "chunk", "prompts", "prompt_len", "gen_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    for m in args.kv_sim:
        if not set(m.split("+")) <= set(SIM_PARTS):
            p.error(f"--kv-sim {m}: parts must be of {SIM_PARTS}")
    if args.chunk % PAGE_SIZE or args.tokens % args.chunk:
        p.error(
            f"--chunk={args.chunk} must be a multiple of {PAGE_SIZE} and divide "
            f"--tokens={args.tokens}"
        )
    return args


def kv_settings(args, params, cfg, ids, tok):
    """``(first, settings)``: the baseline's first-chunk K/V (None unless a flag needs it) and
    name -> (kv_cache_dtype, KV pool dtype, KV cache settings, quantization, fp8_gemm) of every
    setting, the fp8 KV ones with the means and scales the flags ask for."""
    first = (
        first_chunk_kv(params, cfg, ids, args.chunk)
        if args.kv_sim or args.kv_smooth == "first-chunk" or args.kv_scales == "calibrated"
        else None
    )
    means = (
        first_chunk_means(first)
        if args.kv_smooth == "first-chunk"
        else kv_means(params, cfg, calibration_ids(tok), PAGE_SIZE)
        if args.kv_smooth
        else None
    )
    kv_set = {} if means is None else dict(k_mean=means[0], v_mean=means[1])
    if args.kv_scales == "calibrated":
        kv_set.update(zip(("k_scale", "v_scale"), calibrated_scales(first, args.margin, means)))
    fp8 = KV_CACHE_DTYPES[args.kv_cache_dtype]
    settings = {
        "auto": ("auto", jnp.float32, None, None, "w8a16"),
        "kv": (args.kv_cache_dtype, fp8, kv_set, None, "w8a16"),
        "weights": ("auto", jnp.float32, None, "fp8", "w8a16"),
        "both": (args.kv_cache_dtype, fp8, kv_set, "fp8", "w8a16"),
        "w8a8": ("auto", jnp.float32, None, "fp8", "w8a8"),
        "w8a8+kv": (args.kv_cache_dtype, fp8, kv_set, "fp8", "w8a8"),
    }
    return first, settings


def smoothed_settings(args, params, cfg, ids, tok, settings) -> dict:
    """name -> the params each setting runs: ``params``, but for ``--smooth-settings`` (with
    ``--smoothquant`` above 0) `smooth_params` of them over the engine's calibration text (the
    engine's own SmoothQuant), their ``settings`` redone over those (the KV means of V change)."""
    served = dict.fromkeys(settings, params)
    if args.smoothquant and (w8a8 := [n for n in args.settings if n in args.smooth_settings]):
        smooth, _ = smooth_params(params, cfg, calibration_ids(tok), args.smoothquant)
        _, redone = kv_settings(args, smooth, cfg, ids, tok)
        settings.update({n: redone[n] for n in w8a8})
        served.update(dict.fromkeys(w8a8, smooth))
    return served


def setting_row(name, setting, params, cfg, ids, prompts, args, smoothquant=None) -> dict:
    """One engine setting's row: its perplexity (printed to stderr with its seconds) and, unless
    ``--perplexity-only``, its greedy tokens in ``gen``; ``smoothquant``: the alpha ``params``
    were smoothed with (None: not), recorded."""
    kv_cache_dtype, kv_dtype, sc, quant, fp8_gemm = setting
    t = time.perf_counter()
    p = params if quant is None else quantize_params(params, None)
    kernels = ModelKernels(fp8_gemm=fp8_gemm)
    nll, _ = teacher_forced(p, cfg, ids, args.chunk, kv_dtype, sc, kernels=kernels)
    print(
        f"{name}: perplexity {np.exp(nll):.4f} in {time.perf_counter() - t:.0f} s",
        file=sys.stderr,
    )
    gen = (
        None
        if args.perplexity_only
        else greedy(params, cfg, prompts, args.gen_tokens, kv_cache_dtype, sc, quant, fp8_gemm)
    )
    return dict(
        kv_cache_dtype=kv_cache_dtype,
        quantization=quant,
        fp8_gemm=fp8_gemm if quant else None,
        smoothquant=smoothquant,
        kv_scales=args.kv_scales if kv_cache_dtype != "auto" else None,
        kv_method=(
            None
            if kv_cache_dtype == "auto"
            else f"engine+smooth ({args.kv_smooth})"
            if args.kv_smooth
            else "engine"
        ),
        ppl=float(np.exp(nll)),
        gen=gen,
        seconds=time.perf_counter() - t,
    )


def compare_to_base(rows) -> None:
    """Give every row its ``ppl_rel`` and ``greedy_agreement`` against the first (the baseline),
    replacing its ``gen``."""
    base, base_gen = rows[0], rows[0]["gen"]
    for r in rows:
        r["ppl_rel"] = r["ppl"] / base["ppl"] - 1.0
        gen = r.pop("gen")
        r["greedy_agreement"] = None if gen is None else agreement(base_gen, gen)


def report(rows, args, model_path) -> None:
    """Print the table and append one JSON line per row (bench="accuracy") to ``--out``."""
    print(
        f"SmolLM2-135M, float32 compute, {args.tokens} tokens of pydoc_data topics, chunks of "
        f"{args.chunk}; greedy {args.prompts} x {args.gen_tokens}"
    )
    print(
        f"{'kv_cache_dtype':>14} {'weights':>13} {'scales':>10} {'kv method':>24} "
        f"{'perplexity':>11} {'vs auto':>8} {'agreement':>9}"
    )
    stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    with open(args.out, "a") as f:
        for r in rows:
            agree, sq = r["greedy_agreement"], r.get("smoothquant")
            weights = (r.get("fp8_gemm") or str(r["quantization"])) + (f" sq {sq}" if sq else "")
            print(
                f"{r['kv_cache_dtype']:>14} {weights:>13} "
                f"{str(r['kv_scales']):>10} {str(r['kv_method']):>24} {r['ppl']:>11.4f} "
                f"{100 * r['ppl_rel']:>+7.2f}% {'-' if agree is None else f'{agree:.3f}':>9}"
            )
            f.write(
                json.dumps(
                    dict(
                        bench="accuracy",
                        model=os.path.basename(model_path),
                        compute_dtype="float32",
                        tokens=args.tokens,
                        chunk=args.chunk,
                        prompts=args.prompts,
                        gen_tokens=args.gen_tokens,
                        margin=args.margin if r["kv_scales"] == "calibrated" else None,
                        **r,
                        commit=git_commit(),
                        time=stamp,
                    )
                )
                + "\n"
            )


def main(argv=None) -> None:
    args = parse_args(argv)
    from checkpoints_tools.default_model import default_model_path
    from jaxinfer.runner.loading import load_model

    t0 = time.perf_counter()
    loaded = load_model(args.model or default_model_path(), "float32")
    print(f"loaded in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    cfg, params, tok = loaded.config, loaded.params, loaded.tokenizer
    ids = np.asarray(tok.encode(corpus_text()[: 8 * args.tokens])[: args.tokens], np.int32)
    if len(ids) < args.tokens:
        raise SystemExit(f"the corpus has only {len(ids)} tokens; lower --tokens")
    prompts = prompt_ids(tok, args.prompts, args.prompt_len)
    first, settings = kv_settings(args, params, cfg, ids, tok)
    served = smoothed_settings(args, params, cfg, ids, tok, settings)
    rows = [
        setting_row(
            name,
            settings[name],
            served[name],
            *(cfg, ids, prompts, args),
            args.smoothquant if served[name] is not params else None,
        )
        for name in ("auto", *args.settings)
    ]
    rows += [simulated(params, cfg, ids, args, m, first) for m in args.kv_sim]
    rows += [
        jittered(params, cfg, ids, args, settings["kv"], seed) for seed in range(1, args.jitter + 1)
    ]
    compare_to_base(rows)
    report(rows, args, args.model or default_model_path())
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
