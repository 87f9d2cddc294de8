"""``python scripts/convert_checkpoint.py SRC DST [--dtype bfloat16|float32]``: an HF safetensors directory
or a GGUF file -> an Orbax checkpoint directory that ``load_model`` reads without conversion.
Errors: one line ``error: ...`` on stderr, exit status 2 (SRC checked before any tensor is read)."""

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxinfer.cli_args import Parser, fail  # noqa: E402


def convert(src: str, dst: str, dtype: str = "bfloat16") -> None:
    """Save SRC (HF dir or GGUF file), its tokenizer and EOS ids as an Orbax checkpoint at DST
    (removed on failure; left empty if it was). FileNotFoundError: no SRC; FileExistsError: DST
    not empty; ValueError: SRC not HF/GGUF, unsupported, bad tensors, or no tokenizer."""
    from checkpoints_tools.loader import open_checkpoint
    from jaxinfer.config import ModelConfig
    from jaxinfer.runner.loading import load_model, save_checkpoint

    ckpt = open_checkpoint(src)
    if ckpt.format == "orbax":
        raise ValueError(f"SRC {src!r} is already an Orbax checkpoint; nothing to convert")
    ModelConfig.from_checkpoint(ckpt)  # an unsupported config fails before DST is looked at
    existed = os.path.exists(dst)
    if existed and (not os.path.isdir(dst) or os.listdir(dst)):
        raise FileExistsError(f"DST {dst!r} exists and is not empty; choose a new directory")
    m = load_model(ckpt, dtype)
    try:
        save_checkpoint(dst, m.config, m.params, m.tokenizer, ckpt.generation_eos_ids)
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)
        if existed:  # it was an empty directory: leave it so
            os.makedirs(dst, exist_ok=True)
        raise


def build_parser() -> argparse.ArgumentParser:
    ap = Parser("python scripts/convert_checkpoint.py", "Convert an HF safetensors directory or a GGUF file "
                "(Llama / Qwen3) into an Orbax checkpoint directory that jaxinfer loads without "
                "conversion.")
    ap.add_argument("src", metavar="SRC", help="HF model directory (config.json + *.safetensors) "
                    "or a .gguf file")
    ap.add_argument("dst", metavar="DST", help="new (or empty) output directory")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="parameter dtype stored in the checkpoint")
    return ap


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 2 bad input)."""
    try:
        args = build_parser().parse_args(argv)
        convert(args.src, args.dst, args.dtype)
    except (FileNotFoundError, FileExistsError, NotADirectoryError, ValueError) as e:
        return fail(str(e) or type(e).__name__)
    print(f"wrote {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
