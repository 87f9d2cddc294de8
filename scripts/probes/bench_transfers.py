"""Host cost of sending one engine step's small inputs to the device, three ways side by side.

A step has ~15 small numpy input arrays (tokens, positions, slot mapping, sampling
fields, block tables, ...). This measures, for batch sizes ``--batches``, the host time of:

  per_array   ``jnp.asarray`` on each array (what the engine did until 989f578)
  device_put  one ``jax.device_put`` call on the list
  packed      the arrays concatenated on the host into one int32 buffer, one ``jnp.asarray``
              (the engine now sends such a buffer: `jaxinfer.step_input.pack`)

each with the device idle and with the device busy (a chain of matmuls in flight), so a transfer
that waits for the compute stream shows. Appends JSON objects (bench="transfers") to ``--out``.

    python scripts/probes/bench_transfers.py [--batches 32 256] [--reps 50]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from scripts.run_info import git_commit, xla_flags  # noqa: E402


def step_arrays(B: int, M: int) -> list[np.ndarray]:
    """Arrays shaped and typed like one decode step's host inputs (`HostBatch`)."""
    i32 = lambda *s: np.zeros(s, np.int32)  # noqa: E731
    f32 = lambda *s: np.ones(s, np.float32)  # noqa: E731
    return [
        i32(B, 1),
        i32(B, 1),
        i32(B, 1),
        i32(B),
        f32(B),
        i32(B),
        f32(B),
        f32(B),
        f32(B),
        np.zeros((B,), np.uint32),
        i32(B),
        i32(B, 0),
        i32(B),
        i32(B, M),
        i32(B),
    ]


def parse_args():
    """The command line (see the module docstring); exits with a usage error unless every count
    is positive."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--pages", type=int, default=128, help="block table width M")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="benchmarks/h200.jsonl")
    args = ap.parse_args()
    if min(args.batches) < 1 or args.pages < 1 or args.reps < 1:
        ap.error("--batches, --pages and --reps must be positive")
    return args


def modes(arrays):
    """name -> a call sending ``arrays`` to the device that way (module docstring)."""
    import jax
    import jax.numpy as jnp

    return {
        "per_array": lambda: [jnp.asarray(a) for a in arrays],
        "device_put": lambda: jax.device_put(arrays),
        "packed": lambda: jnp.asarray(
            np.concatenate([a.view(np.int32).reshape(-1) for a in arrays])
        ),
    }


def host_seconds(fn, chain, x, busy: bool, reps: int) -> float:
    """Total host seconds of ``reps`` calls of ``fn`` (each waited for before the next), with
    ``chain(x)`` dispatched just before each call when ``busy``."""
    import jax

    total = 0.0
    for _ in range(reps):
        pending = chain(x) if busy else None
        t = time.perf_counter()
        out = fn()
        total += time.perf_counter() - t
        jax.block_until_ready(out)
        if pending is not None:
            pending.block_until_ready()
    return total


def report(rows, out: str) -> None:
    """Append the rows as JSON lines to ``out`` and print the table."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "a") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")
    print(f"{'B':>4} {'mode':<11} {'device':<6} {'host us/step':>12}")
    for r in rows:
        print(
            f"{r['B']:>4} {r['mode']:<11} {'busy' if r['device_busy'] else 'idle':<6} "
            f"{r['us_per_step']:>12.1f}"
        )


def main() -> None:
    args = parse_args()
    import jax
    import jax.numpy as jnp

    x = jnp.ones((8192, 8192), jnp.bfloat16)
    chain = jax.jit(lambda a: [a := a @ a * 1e-4 for _ in range(8)][-1])
    chain(x).block_until_ready()
    meta = dict(
        bench="transfers",
        jax=jax.__version__,
        device=jax.devices()[0].device_kind,
        date=datetime.date.today().isoformat(),
        commit=git_commit(),
        xla_flags=xla_flags(),
        pages=args.pages,
    )
    rows = []
    for B in args.batches:
        arrays = step_arrays(B, args.pages)
        for name, fn in modes(arrays).items():
            jax.block_until_ready(fn())  # warm
            for busy in (False, True):
                total = host_seconds(fn, chain, x, busy, args.reps)
                rows.append(
                    dict(
                        meta,
                        B=B,
                        mode=name,
                        device_busy=busy,
                        arrays=len(arrays),
                        us_per_step=total / args.reps * 1e6,
                    )
                )
    report(rows, args.out)


if __name__ == "__main__":
    main()
