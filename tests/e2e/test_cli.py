"""Acceptance 7 for the CLI: the default model answers; what ``python -m jaxinfer.generate``
prints (streams, --json, --n and --logprobs, prompts files). Bad input: test_cli_errors.py;
options reaching `LLM`: test_cli_options.py."""

import csv
import json
import os

from .cli_runs import run_cli, run_main

MEMORY_TRACE = os.path.join(
    os.path.dirname(__file__), "..", "..", "scripts", "probes", "memory_trace.py"
)  # generate's CLI with a memory trace


def test_json_prompts_file_and_bad_prompt_in_batch(shared_llm, capsys, tmp_path):
    """--json, a .jsonl prompts file with a prompt over max_model_len: the good one still answers,
    the bad one is one error line, exit 2; with --verbose the progress and phase lines go to stderr
    and stdout holds JSON only (in this process on the shared LLM; the ``python -m`` run below
    loads the default model)."""
    f = tmp_path / "prompts.jsonl"
    too_long = "word " * 600  # 3,000 tokens of the character-level tokenizer
    f.write_text(
        json.dumps({"prompt": "What is the capital of France?"})
        + "\n"
        + json.dumps(too_long)
        + "\n"
    )
    code, out, err = run_main(
        capsys,
        *("--model", str(tmp_path), "--prompts-file", str(f), "--max-tokens", "16"),
        *("--json", "--verbose"),
    )
    assert code == 2, err
    rows = [json.loads(line) for line in out.splitlines()]  # nothing else on stdout
    assert len(rows) == 1 and rows[0]["index"] == 0
    # the raw prompt (no chat template) continues the text; the --chat run below checks the answer
    assert rows[0]["token_ids"]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "prompt 1" in errors[0]
    assert str(shared_llm.engine.max_model_len) in errors[0]
    assert err.splitlines()[0] == f"loading {tmp_path.name}"  # the progress line, first
    assert "Traceback" not in err


def test_default_model_chat_stream_answers_paris(tmp_path, smollm_cli_args):
    trace = tmp_path / "mem.csv"
    r = run_cli(
        str(trace),
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "16",
        "--stream",
        *smollm_cli_args,
        cmd=[MEMORY_TRACE],
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "generated tokens:" in r.stderr and "TTFT" in r.stderr and "TTFT" not in r.stdout
    # the probe's memory trace: a header, one row before generation and one per step; pages used
    rows = list(csv.DictReader(trace.open()))
    assert len(rows) >= 3
    assert int(rows[0]["pages_in_use"]) == 0
    assert max(int(r["pages_in_use"]) for r in rows) >= 2  # chat prompt + answer span > 1 page
    assert int(rows[1]["weights_bytes"]) > 100e6 and int(rows[1]["kv_pool_bytes"]) > 0


def test_n_samples_and_logprobs(shared_llm, capsys):
    """--n 2 --logprobs 2: per sample a ``--- [i] 'prompt' sample j`` line, its text, then one line
    per token: the token (repr), its log-probability and ``top:`` the 2 likeliest; --json: one
    object per sample with "logprobs" per token. Seeded, so both formats carry the same samples.
    The request is test_engine_door.py's (`PARAMS`): no step shape to compile for it."""
    args = (
        "--prompt",
        "the door of the engine",
        "--max-tokens",
        "9",
        "--n",
        "2",
        "--seed",
        "7",
        "--temperature",
        "0.8",
        "--ignore-eos",
        "--logprobs",
        "2",
    )
    code, out, err = run_main(capsys, *args, "--json")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["index"], r["sample"]) for r in rows] == [(0, 0), (0, 1)]
    for r in rows:
        assert len(r["logprobs"]) == len(r["token_ids"]) == 9
        for e in r["logprobs"]:
            tops = [lp for _, lp in e["top"]]
            assert len(tops) == 2 and tops == sorted(tops, reverse=True) and e["logprob"] <= 0
            assert e["logprob"] <= tops[0] + 1e-6
    code, out, err = run_main(capsys, *args)
    assert code == 0, err
    lines = out.splitlines()
    for j, r in enumerate(rows):
        at = lines.index(f"--- [0] 'the door of the engine' sample {j}") + 1
        text = r["text"].split("\n")  # the text may hold newlines
        assert lines[at : at + len(text)] == text
        for line, e in zip(lines[at + len(text) :][:9], r["logprobs"], strict=True):
            assert line == f"  {e['token']!r} {e['logprob']:.4f}  top: " + ", ".join(
                f"{t!r} {lp:.4f}" for t, lp in e["top"]
            )
    assert "generated tokens: 18" in err


def test_stream_with_stop_string_prints_no_empty_deltas(shared_llm, capsys):
    """Text held back while it may begin a stop string is not streamed as an empty ``[i]`` line."""
    # a 40-character stop string holds back the first tokens' text until the request finishes
    code, out, err = run_main(
        capsys,
        "--prompt",
        "The capital of France is",
        "--prompt",
        "List three colours:",
        "--max-tokens",
        "6",
        "--stream",
        "--stop",
        "z" * 40,
    )
    assert code == 0, err
    lines = [ln for ln in out.splitlines() if ln.startswith("[")]
    assert lines, out
    assert all(ln.split("] ", 1)[1] if "] " in ln else "" for ln in lines), lines


def test_prompts_file_lines_end_only_at_newline(tmp_path):
    """U+2028, U+0085, form feed, vertical tab and a lone \\r stay inside a prompt (not
    str.splitlines); \\r\\n ends a line; a .jsonl line holding U+2028 is one valid JSON string."""
    from jaxinfer.generate import _read_prompts_file

    f = tmp_path / "p.txt"
    f.write_bytes("a\u2028b\x0cc\r\nd\x0be\x85f\rg\n\n".encode())
    assert _read_prompts_file(str(f)) == ["a\u2028b\x0cc", "d\x0be\x85f\rg"]
    j = tmp_path / "p.jsonl"
    j.write_text(
        json.dumps({"prompt": "x\u2028y"}, ensure_ascii=False)
        + "\r\n"
        + json.dumps("z\x0c")
        + "\n",
        encoding="utf-8",
    )
    assert _read_prompts_file(str(j)) == ["x\u2028y", "z\x0c"]


def test_cold_cache_compiles_the_first_steps_before_they_run(
    tiny_llm, monkeypatch, capsys, tmp_path
):
    """With an empty compilation cache the CLI compiles its first steps' programs together before
    generating (each prefill step and the first decode step): a two-token run compiles nothing
    in a step; `--verbose` counts those compiles in its compile phase."""
    import jaxinfer.llm

    llm = tiny_llm(max_compiles=4, max_num_seqs=2)  # an engine of its own: nothing compiled yet
    monkeypatch.setattr(jaxinfer.llm, "LLM", lambda *a, **k: llm)
    cold = ("--compilation-cache-dir", str(tmp_path / "cc"))
    code, out, err = run_main(
        capsys, "--prompt", "hi there", "--max-tokens", "2", *cold, "--verbose"
    )
    assert code == 0, err
    stats = llm.engine.stats()
    assert stats.num_lazy_compiles == 0
    assert {k.decode for k in stats.forward_shapes} == {True, False}  # the prefill and a decode
    assert float(err.split("compile ")[1].split(" s")[0]) > 0
