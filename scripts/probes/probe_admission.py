"""Which PASS_LIMIT (cache-aware admission's bound) lowers mean TTFT on bench_prefix_cache's shared
workload: the real Scheduler and BlockManager driven by a step-time cost model fitted to the H200
when steps were prefill or decode (prefill 10 ms + 25 us per token, decode 8 ms + 50 us per row;
cache off gave 7.7 s mean TTFT against 7.4 s measured). A mixed step costs 10 ms + 50 us per
decode row + 25 us per prefill token (a 1-token row counts as decode). Host only, seconds on a CPU.

    python scripts/probes/probe_admission.py
"""

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from jaxinfer.engine import scheduler as S
from jaxinfer.engine.block_manager import BlockManager
from jaxinfer.engine.sequence import Sequence
from jaxinfer.sampling_params import SamplingParams


def sim(
    limit,
    caching=True,
    P=16,
    systems=32,
    qs=8,
    syslen=2048,
    out=128,
    budget=8192,
    seqs=256,
    pages=36003,
):
    S.PASS_LIMIT = limit  # the probe's knob
    rng = random.Random(0)
    sysp = [[rng.randrange(100000) for _ in range(syslen)] for _ in range(systems)]
    reqs = [
        (s, [rng.randrange(100000) for _ in range(rng.randint(64, 256))])
        for s in range(systems)
        for _ in range(qs)
    ]
    rng.shuffle(reqs)
    sched = S.Scheduler(
        BlockManager(pages, P, enable_prefix_caching=caching),
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
        max_model_len=4096,
        page_size=P,
    )
    allseq = []
    for i, (s, q) in enumerate(reqs):
        seq = Sequence(str(i), sysp[s] + q, SamplingParams(max_tokens=out, ignore_eos=True), 0)
        sched.add(seq)
        allseq.append(seq)
    t, ttft, inflight = 0.0, {}, []
    while sched.has_unfinished() or inflight:
        b = sched.schedule()
        if b is not None:
            rows1 = sum(n == 1 for n in b.num_new_tokens)  # decode rows, one token each
            pre = sum(b.num_new_tokens) - rows1  # prefill tokens
            t += (0.01 if pre else 0.008) + rows1 * 5e-5 + pre * 2.5e-5
            inflight.append(b)
        while inflight and (len(inflight) > 1 or b is None):
            bb = inflight.pop(0)
            outs = [1 if d else None for d in bb.do_sample]
            for sq, o in zip(bb.seqs, outs):
                if o is not None and sq.request_id not in ttft:
                    ttft[sq.request_id] = t
            sched.postprocess(bb, outs)
    return sum(ttft.values()) / len(ttft), t


off = sim(64, caching=False)
print("off", off)
for lim in (16, 64, 128, 256, 10**9):
    on = sim(lim)
    print(lim, on, off[0] / on[0])
