"""One question: do finer fp8 scales (HF's 128 x 128 blocks instead of one per output channel)
raise SmolLM2-135M's greedy agreement with float32? Same prompts and measure as
``scripts/eval_weights_accuracy.py`` (20 prompts x 64 tokens, agreement up to the first
divergence); the weights quantised at load with ``weight_block_size`` (128, 128). CPU, float32.

    python scripts/probes/probe_fp8_block_scales.py
"""

import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from scripts import eval_weights_accuracy as ev  # noqa: E402


def main() -> None:
    from checkpoints_tools.default_model import default_model_path
    from jaxinfer import LLM
    from jaxinfer.loading import load_model

    m = load_model(default_model_path(), "float32")
    ids = m.tokenizer.encode(ev.english_text(), add_special_tokens=False)
    stride = (len(ids) - 4096) // 20
    prompts = [ids[4096 + i * stride:][:32] for i in range(20)]
    kw = dict(max_model_len=128, max_num_seqs=20, dtype="float32")
    base = ev.greedy(LLM.from_params(m.config, m.params, **kw), prompts, 64)
    cfg = dataclasses.replace(m.config, weight_block_size=(128, 128))
    toks = ev.greedy(LLM.from_params(cfg, m.params, quantization="fp8", **kw), prompts, 64)
    print("fp8 128x128 blocks: greedy agreement",
          sum(ev.agreement(a, b) for a, b in zip(toks, base)) / len(prompts))


if __name__ == "__main__":
    main()
