"""CLI: ``python -m jaxinfer.generate --prompt "..." [--chat] [--stream]``. Bad input: a stderr
line, exit code 2 (valid prompts still run). On a terminal, short progress lines on stderr
(`_progress`)."""

import argparse
import dataclasses
import gc
import importlib
import json
import os
import sys
import time
from collections.abc import Callable

from jaxinfer.cli_args import add_lora_path, engine_parser, fail, flag, lora_request, make_llm
from jaxinfer.config import EngineConfig
from jaxinfer.lora.peft import AdapterError

SAMPLING_OPTIONS = (  # SamplingParams field, type, CLI default, help
    ("max_tokens", int, 64, "most tokens generated per prompt"),
    ("temperature", float, 0.0, "0 = greedy"),
    ("top_p", float, 1.0, "nucleus sampling mass, in (0, 1]"),
    ("top_k", int, -1, "sample from the k likeliest; 0 or -1 = off"),
    ("min_p", float, 0.0, "drop tokens below min_p x the top probability; 0 = off"),
    (
        "repetition_penalty",
        float,
        1.0,
        "> 1 discourages tokens already in the prompt or output; 1 = off",
    ),
    ("presence_penalty", float, 0.0, "in [-2, 2]: subtracted from tokens already generated"),
    ("frequency_penalty", float, 0.0, "in [-2, 2]: subtracted per time a token was generated"),
    ("min_tokens", int, 0, "EOS and stop tokens are masked until this many tokens"),
    (
        "seed",
        int,
        None,
        "per-request seed; unseeded requests draw from the engine's seed 0, so a "
        "run is reproducible either way",
    ),
    ("n", int, 1, "samples per prompt (sample i seeded by (seed, i))"),
    ("logprobs", int, None, "print each generated token's top N (0 to 20) log-probabilities"),
)


def build_parser() -> argparse.ArgumentParser:
    p = engine_parser(
        "python -m jaxinfer.generate",
        "Generate text with jaxinfer (continuous batching, paged KV cache).",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer dir or GGUF file to use instead of the model's",
    )
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    add_lora_path(p)
    p.add_argument(
        "--prompts-file",
        default=None,
        help="one prompt per line: plain text, or in "
        'a .jsonl file a JSON string or {"prompt": ...}',
    )
    p.add_argument(
        "--chat", action="store_true", help="wrap each prompt in the model's chat template"
    )
    for name, typ, default, help in SAMPLING_OPTIONS:
        p.add_argument(flag(name), type=typ, default=default, help=help)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    for opt, help in (
        ("--ignore-eos", "keep generating past EOS"),
        ("--include-stop-str-in-output", "keep the stop string in the text"),
        ("--stream", "print tokens as they arrive"),
        ("--json", "one JSON object per request on stdout"),
    ):
        p.add_argument(opt, action="store_true", help=help)
    seqs = p._option_string_actions["--max-num-seqs"]  # argparse has no public lookup
    seqs.default, seqs.help = (
        None,
        (
            "most sequences in one step (default: the samples asked, at "
            f"most {EngineConfig.max_num_seqs}; sizes the CPU's KV pool)"
        ),
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print the seconds of each phase (imports, load, compile, first token) on stderr",
    )
    return p


def _read_prompts_file(path: str) -> list[str]:
    """Non-blank lines of ``path``, split at \\n or \\r\\n only; FileNotFoundError, ValueError."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--prompts-file {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"--prompts-file {path!r} is not a file")
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            lines = [
                (n, s.removesuffix("\r"))
                for n, s in enumerate(f.read().split("\n"), 1)
                if s.strip()
            ]
    except UnicodeDecodeError as e:
        raise ValueError(
            f"--prompts-file {path!r} is not UTF-8 text (byte {e.start}: {e.reason})"
        ) from None
    for k, (n, line) in enumerate(lines if path.endswith(".jsonl") else ()):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj := obj.get("prompt") if isinstance(obj, dict) else obj, str):
            raise ValueError(f'{path}:{n}: expected a JSON string or {{"prompt": str}}')
        lines[k] = n, obj
    return [s for _, s in lines]


def _home(path: str) -> str:
    """``path`` with the home directory written ``~``."""
    home = os.path.expanduser("~")
    return "~" + path[len(home) :] if home != "~" and path.startswith(home + os.sep) else path


def _progress(args) -> Callable[[str], None]:
    """``say(line)``: one progress line on stderr when a person watches it (a terminal, or
    ``--verbose``), so that a first run's slow start (a GGUF file converted once, the steps
    compiled) is not silent; nothing when stderr is a pipe or a file, where errors stay one
    line and the statistics line is all that comes besides them."""
    on = args.verbose or sys.stderr.isatty()

    def say(line: str) -> None:
        if on:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    return say


def _loading_line(model: str | None) -> str | None:
    """``loading NAME``, with where a GGUF file not converted yet goes (once); None: no such
    model (`make_llm` says what is wrong)."""
    from checkpoints_tools import gguf_cache
    from checkpoints_tools.default_model import default_model_path

    try:
        path = model or default_model_path()
    except FileNotFoundError:
        return None
    if not os.path.exists(path):
        return None
    line = f"loading {os.path.basename(os.path.normpath(path))}"
    if (target := gguf_cache.pending(path)) is not None:
        line += f" (first run: converting it to {_home(target)}, once)"
    return line


def _compile_line(cache_dir: str | None) -> str | None:
    """What the first steps will do when the persistent compilation cache (``cache_dir``:
    ``--compilation-cache-dir``) holds nothing yet or is off; None when it holds compiled
    programs, which the steps load. Read before the model loads: loading compiles (and caches)
    small programs of its own."""
    import jax

    if cache_dir == "auto":  # as `ModelRunner` resolves it: JAX's own, else the user's cache
        cache_dir = jax.config.jax_compilation_cache_dir or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or "~/.cache", "jaxinfer", "jax"
        )
    elif cache_dir in (None, "none"):
        cache_dir = jax.config.jax_compilation_cache_dir  # JAX's own, if set, still works
    if not cache_dir:
        return "compiling the model's steps (no compilation cache)"
    d = os.path.abspath(os.path.expanduser(cache_dir))
    if os.path.isdir(d) and any(os.scandir(d)):
        return None
    return f"compiling the model's steps (first run; later runs load them from {_home(d)})"


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """The CLI; returns the exit code (0; 2: bad input; 130: interrupted). ``own_process``: this
    process runs the command alone (``python -m``): Python's cyclic garbage collector stops
    scanning the objects alive before and after the model loads (`gc.freeze`; its full
    collections took 0.5 s of a 5 s run, 0.2 s so)."""
    try:
        return _main(argv, own_process)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except BrokenPipeError:  # e.g. `... --stream | head`: the reader left; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _print(args, i: int, prompts: list[str], o, c) -> None:
    """Sample ``c`` of prompt ``i``'s output ``o``: a JSON line (``--json``), or its text after a
    ``--- [i] 'prompt' [sample j]`` line when there are several, then with ``--logprobs N`` one
    line per token: its text (repr), its log-probability, ``top:`` the N likeliest with theirs."""
    top = c.top_logprobs(args.logprobs) if args.logprobs is not None else None
    if args.json:  # "logprobs": null unless asked
        return print(
            json.dumps(
                {
                    "index": i,
                    "sample": c.index,
                    "prompt": prompts[i],
                    "text": c.text,
                    "token_ids": list(c.token_ids),
                    "finish_reason": c.finish_reason,
                    "prompt_tokens": len(o.prompt_token_ids),
                    "ttft_s": o.metrics and o.metrics.ttft_s,
                    "logprobs": top and [{"token": s, "logprob": lp, "top": t} for s, lp, t in top],
                }
            )
        )
    if len(prompts) > 1 or args.n > 1:
        print(f"--- [{i}] {prompts[i]!r}" + (f" sample {c.index}" if args.n > 1 else ""))
    print(c.text)
    for s, lp, t in top or ():
        print(f"  {s!r} {lp:.4f}  top: " + ", ".join(f"{u!r} {x:.4f}" for u, x in t))


EMPTY = "{} empty: every prompt needs text (with --chat too)"


def _listed(indices) -> str:
    return ", ".join(map(str, sorted(indices)))


def _checked_prompts(args) -> tuple[list[str], set[int]]:
    """The prompts of ``args`` and the indices of the empty ones, before the model loads.
    ValueError: --stream with what it cannot print, no prompt, or every prompt empty."""
    if args.stream and (args.json or args.n > 1 or args.logprobs is not None):
        raise ValueError(
            "--stream prints one sample's text per prompt as it comes: it cannot "
            "be combined with --json, --n above 1 or --logprobs"
        )
    prompts = args.prompt + (_read_prompts_file(args.prompts_file) if args.prompts_file else [])
    if not prompts:
        raise ValueError("no prompt given: use --prompt TEXT (repeatable) or --prompts-file FILE")
    empty = {i for i, p in enumerate(prompts) if not p}
    if len(empty) == len(prompts):
        many = len(empty) > 1
        raise ValueError(
            EMPTY.format(f"prompt{'s' * many} {_listed(empty)} {'are' if many else 'is'}")
        )
    return prompts, empty


def _chat_ids(llm, prompt: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": prompt}])


def _print_outputs(args, prompts: list[str], empty: set[int], outs) -> None:
    """Each prompt's answers on stdout (not with --stream: printed as they came), or its error
    on stderr; ``outs``: the outputs of the prompts not in ``empty``, in order."""
    ran = iter(outs)
    for i in range(len(prompts)):
        if i in empty:
            sys.stderr.write(f"error: {EMPTY.format(f'prompt {i} is')}\n")
        elif (o := next(ran)).error:
            sys.stderr.write(f"error: prompt {i}: {o.error}\n")
        elif not args.stream:
            for c in o.outputs:
                _print(args, i, prompts, o, c)


def _precompile_first_steps(llm, inputs, params) -> float:
    """Compile the programs of the run's first steps together (`LLM.precompile` of the run at
    ``max_tokens`` 2: each prefill step, the first decode step), so that on a cold compilation
    cache two cores compile them at once (first run on 2 cores: 16 s -> 13 s); later shapes
    compile when reached. Returns its seconds; 0.0 when a prompt is rejected (generate says)."""
    k = 2 if params.max_tokens is None else min(params.max_tokens, 2)
    first = dataclasses.replace(params, max_tokens=k, min_tokens=min(params.min_tokens, k))
    try:
        return llm.precompile(inputs, first)["seconds"]
    except ValueError:
        return 0.0


def _print_stats(args, llm, ok, wall: float, times: tuple, pre_s: float = 0.0) -> None:
    """The statistics line on stderr (none when every prompt failed; with
    ``--speculative-config``, the mean acceptance length at its end) and, with --verbose, the
    phases from ``times`` (perf_counter at main's start, after imports, at generate) and
    ``pre_s``, `_precompile_first_steps`' seconds (generate's own steps began that much later)."""
    t_start, t_import, t0 = times
    n_gen = sum(len(c.token_ids) for o in ok for c in o.outputs)
    ttfts = [o.metrics.ttft_s for o in ok if o.metrics and o.metrics.ttft_s is not None]
    stats = llm.engine.stats()
    if ok:  # a run whose every prompt failed prints only its errors
        line = (
            f"prompt tokens: {sum(len(o.prompt_token_ids) for o in ok)}, generated "
            f"tokens: {n_gen}, mean TTFT: {sum(ttfts) / max(len(ttfts), 1) * 1e3:.1f} ms, "
            f"throughput: {n_gen / wall if wall > 0 else 0.0:.1f} tok/s (wall time, step "
            f"compiles or cache loads included), shapes: {stats.num_compiles}"
        )
        if args.speculative_config is not None:
            line += f", mean acceptance length: {stats.spec_mean_acceptance_length:.2f}"
        print(line, file=sys.stderr)
    if args.verbose:
        first = min(ttfts, default=float("nan")) + t0 + pre_s - t_start
        print(
            f"phases: imports {t_import - t_start:.1f} s, load {t0 - t_import:.1f} s, compile "
            f"{stats.compile_s + pre_s:.1f} s ({stats.num_compiles} shapes), "
            f"first token {first:.1f} s, total {time.perf_counter() - t_start:.1f} s "
            "(from the start of main)",
            file=sys.stderr,
        )


def _generate(args, llm, inputs: list, params, stream):
    """``llm.generate`` of the CLI's prompts (a prompt's error returned as its output's);
    AdapterError: ``--lora-path``'s weights are unreadable or not the model's (read here, before
    any prompt runs: one error, not one per prompt)."""
    llm.engine.lora.check(lora := lora_request(args))
    return llm.generate(
        inputs,
        params,
        use_tqdm=len(inputs) > 1 and not args.stream and sys.stderr.isatty(),
        on_error="return",
        stream=stream,
        lora_request=lora,
    )


def _main(argv: list[str] | None, own_process: bool) -> int:
    t_start = time.perf_counter()
    from jaxinfer.sampling_params import SamplingParams

    try:  # the options, prompts, SamplingParams and LLM; a bad one: one line, exit code 2
        args = build_parser().parse_args(argv)
        prompts, empty = _checked_prompts(args)
        params = SamplingParams(
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
            include_stop_str_in_output=args.include_stop_str_in_output,
            **{name: getattr(args, name) for name, *_ in SAMPLING_OPTIONS},
        )
        if args.max_num_seqs is None:
            args.max_num_seqs = min(len(prompts) * max(args.n, 1), EngineConfig.max_num_seqs)
        if args.verbose:
            importlib.import_module("jaxinfer.llm")  # timed apart from the load
        t_import = time.perf_counter()
        say, compile_line = _progress(args), _compile_line(args.compilation_cache_dir)
        if line := _loading_line(args.model):
            say(line)
        if own_process:
            gc.freeze()
        llm = make_llm(args, tokenizer=args.tokenizer)
        if own_process:
            gc.freeze()
        kept = [i for i in range(len(prompts)) if i not in empty]
        inputs = [
            {"prompt": prompts[i], "prompt_token_ids": _chat_ids(llm, prompts[i])}
            if args.chat
            else prompts[i]
            for i in kept
        ]
    except (ValueError, FileNotFoundError) as e:
        return fail(str(e))
    if compile_line:
        say(compile_line)

    def print_delta(i, _ids, delta):
        if delta:  # empty: text held back (a possible stop string) or not complete
            sys.stdout.write(f"[{kept[i]}] {delta}\n" if len(prompts) > 1 else delta)
            sys.stdout.flush()

    t0 = time.perf_counter()
    pre_s = _precompile_first_steps(llm, inputs, params) if compile_line else 0.0
    try:
        outs = _generate(args, llm, inputs, params, print_delta if args.stream else None)
    except AdapterError as e:
        return fail(str(e))
    wall, ok = time.perf_counter() - t0, [o for o in outs if not o.error]
    if args.stream:
        sys.stdout.write("\n")
    _print_outputs(args, prompts, empty, outs)
    _print_stats(args, llm, ok, wall, (t_start, t_import, t0), pre_s)
    return 2 if len(ok) < len(prompts) else 0


def _exit(code: int) -> None:
    """End the process with ``code`` once the GGUF cache entry being written is complete
    (`gguf_cache.join`) and stdout and stderr are flushed, without the interpreter's teardown
    (freeing the weights, the KV pool and JAX's objects: 0.6 s of a 5 s run)."""
    from checkpoints_tools import gguf_cache

    gguf_cache.join()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a reader that left (BrokenPipeError)
            pass
    os._exit(code)


if __name__ == "__main__":
    _exit(main(own_process=True))
