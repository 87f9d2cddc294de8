"""The EAGLE-3 head loader (`checkpoints_tools.eagle3`) on a random head for `TINY` in the HF
layout (tests/eagle3_head.py): every tensor mapped exactly once, and a missing, unexpected or
misshapen tensor, another hidden size or architecture, bad aux layers refused by name."""

import json
import shutil

import numpy as np
import pytest
from eagle3_head import AUX, VD, head_config, head_tensors, write_head

from checkpoints_tools.eagle3 import read_eagle3


@pytest.fixture(scope="module")
def head(tiny_cfg, tmp_path_factory) -> tuple[str, dict]:
    """(directory, HF tensors) of the random head for `TINY`."""
    tensors = head_tensors(tiny_cfg, np.random.default_rng(3))
    return write_head(tmp_path_factory.mktemp("eagle3") / "head", tiny_cfg, tensors), tensors


def _read(path, cfg):
    return read_eagle3(path, cfg.hidden_size, cfg.vocab_size, cfg.num_layers)


def test_loader_maps_every_tensor_once(head, tiny_cfg):
    path, hf = head
    ck = _read(path, tiny_cfg)
    assert ck.aux_layers == AUX
    got = ck.tensors
    assert sorted(got) == sorted(
        ["fc", "hidden_norm", "input_norm", "post_norm", "wqkv", "wo"]
        + ["w_gate_up", "w_down", "norm", "lm_head", "d2t"]
    )
    used = sum(x.size for n, x in hf.items() if n != "t2d")
    assert sum(x.size for x in got.values()) == used  # each mapped once, nothing twice
    a = "midlayer.self_attn."
    qkv = np.concatenate([hf[a + p + "_proj.weight"].T for p in "qkv"], axis=1)
    np.testing.assert_array_equal(got["wqkv"], qkv)
    np.testing.assert_array_equal(got["fc"], hf["fc.weight"].T)
    np.testing.assert_array_equal(got["d2t"] + np.arange(VD), np.flatnonzero(hf["t2d"]))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda t: t.pop("midlayer.mlp.up_proj.weight"), "missing tensor 'midlayer.mlp.up_proj"),
        (lambda t: t.update(extra=np.zeros(3, np.float32)), "unexpected tensor 'extra'"),
        (
            lambda t: t.update({"fc.weight": np.zeros((64, 128), np.float32)}),
            r"tensor 'fc.weight' has shape \[64, 128\], expected \[64, 192\]",
        ),
        (lambda t: t.pop("d2t"), "missing tensor 'd2t'"),
    ],
)
def test_loader_refuses_bad_tensors(head, tiny_cfg, tmp_path, change, message):
    tensors = dict(head[1])
    change(tensors)
    with pytest.raises(ValueError, match=message):
        _read(write_head(tmp_path / "h", tiny_cfg, tensors), tiny_cfg)


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(hidden_size=32), "hidden_size=32 does not match the target model's hidden_size=64"),
        (dict(architectures=["LlamaForCausalLM"]), "is not an EAGLE-3 head"),
        (dict(eagle_config={}), r"aux hidden-state layers \[2, 1, -1\] are invalid .* 2 layers"),
    ],
)
def test_loader_refuses_bad_configs(head, tiny_cfg, tmp_path, config, message):
    path = tmp_path / "h"
    shutil.copytree(head[0], path)
    (path / "config.json").write_text(json.dumps(head_config(tiny_cfg, **config)))
    with pytest.raises(ValueError, match=message):
        _read(path, tiny_cfg)


def test_default_aux_layers_are_vllms():
    from checkpoints_tools.eagle3 import aux_layer_ids

    assert aux_layer_ids({}, 32) == (2, 16, 29)
