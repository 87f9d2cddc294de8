"""Command line: ``python -m jaxinfer.generate --prompt "..." [--chat] [--stream]``.

Bad input (missing model, unsupported architecture, empty prompt, out-of-range parameters) prints one
line on stderr and exits with code 2; valid prompts given with it still run and print their output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, no usage dump
        sys.stderr.write(f"error: {message}\n")
        sys.exit(2)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds "(default: X)" where the help text does not already speak of the default and there is
    a default worth showing."""

    def _get_help_string(self, action):
        text = action.help or ""
        d = action.default
        if "default" in text or d is None or d is False or d == [] or d == argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m jaxinfer.generate",
                description="Generate text with jaxinfer (continuous batching, paged KV cache).",
                formatter_class=_Formatter)
    p.add_argument("--model", default=None,
                   help="HF model dir, GGUF file or Orbax dir (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None,
                   help="one prompt per line; a file ending in .jsonl holds JSON per line "
                        "({\"prompt\": ...} or a JSON string), any other file plain text")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--top-k", type=int, default=-1, help="sample from the k likeliest; -1 = off")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min_p x the top probability; 0 = off")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already in the prompt or output; 1 = off")
    p.add_argument("--seed", type=int, default=None,
                   help="per-request seed; unseeded requests draw from the engine's seed 0, so a "
                        "run is reproducible either way")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--json", action="store_true", help="one JSON object per request on stdout")
    g = p.add_argument_group("engine")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="default: the model's max_position_embeddings")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page (a power of 2)")
    g.add_argument("--num-pages", type=int, default=None,
                   help="KV pool size in pages; default: sized from free device memory")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="most sequences in one decode step")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="most prompt tokens in one prefill step (longer prompts are chunked)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 on GPU, float32 on CPU (bfloat16 is slow on CPU)")
    g.add_argument("--memory-trace", default=None, metavar="FILE",
                   help="write a CSV of weights / KV pool / pages in use / other bytes after each step")
    g.add_argument("--attention", default="auto",
                   help="paged-attention back-end for decode: auto, reference, triton, mosaic, "
                        "jax_triton")
    g.add_argument("--prefill-attention", default="auto",
                   help="attention back-end for prefill: auto (= reference for now), reference, "
                        "triton")
    g.add_argument("--qkv-prologue", choices=["auto", "xla", "triton"], default="auto",
                   help="decode steps' q/k norm + RoPE + K/V write: one Pallas kernel per layer "
                        "(triton, GPU only), XLA's fusions (xla), or auto (triton on a GPU where "
                        "the model's shapes allow)")
    g.add_argument("--add-rms-norm", choices=["auto", "xla", "triton"], default="auto",
                   help="residual add + RMSNorm: one Pallas kernel per boundary (triton, GPU "
                        "only), XLA's fusions (xla), or auto (as --qkv-prologue)")
    g.add_argument("--prefill-gemm", choices=["xla", "cublas"], default="xla",
                   help="GEMM back-end of prefill steps: XLA's choice or cuBLAS (GPU; "
                        "ignored on CPU, where XLA has no cuBLAS)")
    g.add_argument("--cublas-decode-min-batch", type=int, default=64, metavar="ROWS",
                   help="decode batch buckets of at least ROWS rows use cuBLAS GEMMs (a "
                        "positive integer, default 64; GPU only, ignored on CPU; a number above "
                        "the largest bucket keeps XLA's GEMMs everywhere)")
    g.add_argument("--compilation-cache-dir", default=None, metavar="DIR",
                   help="JAX persistent compilation cache: a later run with the same DIR loads "
                        "the compiled steps instead of compiling them again")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="dispatch step n+1 before reading back step n's tokens (host work hides "
                        "behind device work); --no-async-scheduling reads each step back first. "
                        "Outputs are the same either way")
    return p


def _read_prompts_file(path: str) -> list[str]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"--prompts-file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"--prompts-file {path!r} is not a file")
    prompts = []
    try:
        with open(path, encoding="utf-8-sig") as f:
            lines = f.read().splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts-file {path!r} is not UTF-8 text (byte {e.start}: "
                         f"{e.reason})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.endswith(".jsonl"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})"
                                 ) from None
            if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                obj = obj["prompt"]
            if not isinstance(obj, str):
                raise ValueError(f"{path}:{n}: expected a JSON string or {{\"prompt\": str}}")
            prompts.append(obj)
        else:
            prompts.append(line)
    return prompts


def _fail(msg: str) -> int:
    sys.stderr.write(f"error: {msg}\n")
    return 2


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except BrokenPipeError:  # e.g. `... --stream | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.json and args.stream:
        return _fail("--json and --stream cannot be combined: --json writes one JSON object per "
                     "request on stdout")
    # Library chatter (transformers' config warnings) would break the one-line error contract.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from jaxinfer.sampling_params import SamplingParams

    try:
        prompts = list(args.prompt)
        if args.prompts_file:
            prompts += _read_prompts_file(args.prompts_file)
        if not prompts:
            return _fail("no prompt given: use --prompt TEXT (repeatable) or --prompts-file FILE")
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                repetition_penalty=args.repetition_penalty, seed=args.seed,
                                stop=tuple(args.stop), ignore_eos=args.ignore_eos)
        if args.model is not None and not os.path.exists(args.model):
            return _fail(f"--model {args.model!r} does not exist")
        from jaxinfer.attention import resolve_backend, resolve_prefill_backend
        from jaxinfer.config import ATTENTION_BACKENDS, PREFILL_ATTENTION_BACKENDS
        # GPU-only kernels on a CPU host: say so before spending seconds loading the model
        if args.attention in ATTENTION_BACKENDS:
            resolve_backend(args.attention)
        if args.prefill_attention in PREFILL_ATTENTION_BACKENDS:
            resolve_prefill_backend(args.prefill_attention)
        from jaxinfer.llm import LLM

        llm = LLM(args.model, max_model_len=args.max_model_len, page_size=args.page_size,
                  num_pages=args.num_pages, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
                  attention=args.attention, prefill_attention=args.prefill_attention,
                  async_scheduling=args.async_scheduling,
                  compilation_cache_dir=args.compilation_cache_dir,
                  qkv_prologue=args.qkv_prologue, add_rms_norm=args.add_rms_norm,
                  prefill_gemm=args.prefill_gemm,
                  cublas_decode_min_batch=args.cublas_decode_min_batch)
        if args.chat:
            inputs = [{"prompt": p, "prompt_token_ids": llm.apply_chat_template(
                [{"role": "user", "content": p}])} for p in prompts]
        else:
            inputs = prompts
    except (ValueError, FileNotFoundError) as e:
        return _fail(str(e))

    def print_delta(i, _ids, delta):
        if not delta:  # a token whose text is held back (a possible stop string) or not complete
            return
        sys.stdout.write(f"[{i}] {delta}\n" if len(prompts) > 1 else delta)
        sys.stdout.flush()

    stream = print_delta if args.stream else None

    if args.memory_trace:
        llm.engine.trace_memory = True
        llm.engine.memory_snapshot()
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=len(prompts) > 1 and not args.stream,
                        on_error="return", stream=stream)
    wall = time.perf_counter() - t0
    if args.stream:
        sys.stdout.write("\n")
    bad = 0
    n_prompt = n_gen = 0
    ttfts = []
    for i, o in enumerate(outs):
        if o.error:
            bad += 1
            sys.stderr.write(f"error: prompt {i}: {o.error}\n")
            continue
        n_prompt += len(o.prompt_token_ids)
        n_gen += len(o.token_ids)
        if o.metrics and o.metrics.ttft_s is not None:
            ttfts.append(o.metrics.ttft_s)
        if args.json:
            print(json.dumps({"index": i, "prompt": prompts[i], "text": o.text,
                              "token_ids": list(o.token_ids),
                              "finish_reason": o.outputs[0].finish_reason,
                              "prompt_tokens": len(o.prompt_token_ids),
                              "ttft_s": o.metrics.ttft_s if o.metrics else None}))
        elif not args.stream:
            if len(prompts) > 1:
                print(f"--- [{i}] {prompts[i]!r}")
            print(o.text)
    ttft = sum(ttfts) / len(ttfts) if ttfts else 0.0
    summary = (f"prompt tokens: {n_prompt}, generated tokens: {n_gen}, mean TTFT: {ttft * 1e3:.1f} ms, "
               f"throughput: {n_gen / wall if wall > 0 else 0.0:.1f} tok/s (wall time, first-run "
               f"compilation included), compiles: {llm.engine.num_compiles}")
    print(summary, file=sys.stderr if args.json else sys.stdout)
    if args.memory_trace:
        try:
            llm.engine.memory.write_csv(args.memory_trace)
        except OSError as e:
            return _fail(f"--memory-trace {args.memory_trace!r}: {e.strerror}")
        print(f"memory: {llm.engine.memory.report()} (trace: {args.memory_trace})",
              file=sys.stderr if args.json else sys.stdout)
    return 2 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
