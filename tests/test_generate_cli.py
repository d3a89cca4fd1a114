"""`dflash generate`: the prompt from --prompt or from --file, byte for byte."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
from tinycode import N_CTX, TARGET, THREADS, drafter_gguf, prompts  # noqa: E402


def run_generate(*args: str, stream: bool = False) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "dflash_gguf.cli",
        "generate",
        "-m",
        str(TARGET),
        "-d",
        str(drafter_gguf("f32")),
        "-c",
        str(N_CTX),
        "-t",
        str(THREADS),
        "--n-max",
        "3",
        "-n",
        "24",
        *([] if stream else ["--no-stream"]),
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_prompt_file_is_read_byte_for_byte(tmp_path: Path) -> None:
    """The bench's first prompt ends with a newline, which `-p "$(...)"` loses: with --file the
    continuation is the one of the exact text (the same as -p given that text), and differs from the
    continuation without the newline."""
    text = prompts()[0]["text"]
    assert text.endswith("\n")
    f = tmp_path / "prompt.txt"
    f.write_bytes(text.encode("utf-8"))
    from_file = run_generate("--file", str(f))
    assert from_file.returncode == 0, from_file.stderr
    assert from_file.stdout == run_generate("-p", text).stdout
    assert from_file.stdout.startswith(text)
    assert from_file.stdout != run_generate("-p", text.rstrip("\n")).stdout


def test_prompt_errors(tmp_path: Path) -> None:
    both = run_generate("-p", "x", "-f", str(TARGET))
    neither = run_generate()
    for r in (both, neither):
        assert r.returncode == 2 and r.stdout == "", r.stderr
        assert r.stderr.strip() == "dflash: error: give the prompt with exactly one of --prompt / -p and --file / -f"
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9\n")
    r = run_generate("-f", str(bad))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"dflash: error: {bad}: cannot read the prompt as UTF-8 text")
    assert "Traceback" not in r.stderr
    missing = run_generate("-f", str(tmp_path / "nope.txt"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_grammar_options(tmp_path: Path) -> None:
    """--grammar and --grammar-file give the same constrained continuation; a bad grammar or file is a
    one-line error naming it, exit code 2."""
    import re

    text = prompts()[0]["text"]
    gbnf = "root ::= [a-z \\n]+"
    inline = run_generate("-p", text, "--grammar", gbnf)
    assert inline.returncode == 0, inline.stderr
    assert re.fullmatch(r"[a-z \n]*", inline.stdout[len(text) :].rstrip("\n")), inline.stdout
    g = tmp_path / "g.gbnf"
    g.write_text(gbnf)
    assert run_generate("-p", text, "--grammar-file", str(g)).stdout == inline.stdout
    bad = run_generate("-p", text, "--grammar", "root ::= [a-z")
    missing = run_generate("-p", text, "--grammar-file", str(tmp_path / "nope.gbnf"))
    both = run_generate("-p", text, "--grammar", gbnf, "--grammar-file", str(g))
    bad_streamed = run_generate("-p", text, "--grammar", "root ::= [a-z", stream=True)  # no prompt echoed first
    assert run_generate("-p", text, "--grammar", gbnf, stream=True).stdout == inline.stdout
    for r, needle in (
        (bad, "grammar"),
        (bad_streamed, "grammar"),
        (missing, "nope.gbnf"),
        (both, "at most one of --grammar, --grammar-file"),
    ):
        assert r.returncode == 2 and r.stdout == "" and needle in r.stderr, (r.returncode, r.stderr[-500:])
        assert "Traceback" not in r.stderr


def test_json_schema_options(tmp_path: Path) -> None:
    """--json-schema / --json-schema-file: the continuation is JSON that follows the schema (the grammar
    ends it); bad schemas and clashing options are one-line errors."""
    import json

    text = prompts()[0]["text"]
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    r = run_generate("-p", text, "--json-schema", schema, "-n", "40")
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout[len(text) :])["n"], int), r.stdout
    f = tmp_path / "schema.json"
    f.write_text(schema)
    assert run_generate("-p", text, "--json-schema-file", str(f), "-n", "40").stdout == r.stdout
    not_json = run_generate("-p", text, "-j", "{type: object}")
    unknown = run_generate("-p", text, "-j", '{"type": "bogus"}')
    clash = run_generate("-p", text, "-j", schema, "--grammar", "root ::= [a-z]+")
    for r, needle in (
        (not_json, "--json-schema: not JSON"),
        (unknown, "cannot be turned into a grammar"),
        (clash, "at most one of --grammar, --json-schema"),
    ):
        assert r.returncode == 2 and r.stdout == "" and needle in r.stderr, (r.returncode, r.stderr[-500:])
        assert "Traceback" not in r.stderr


def test_sampling_options_are_the_api_s() -> None:
    """llama.cpp's --typical / --mirostat / --mirostat-lr / --mirostat-ent reach the sampler: the text is
    the Python API's for the same settings and seed; a bad value is a usage error naming the option."""
    from dflash_gguf import SpeculativeLlama

    text = prompts()[0]["text"]
    r = run_generate(
        "-p", text, "--temp", "1", "--seed", "5", "--mirostat", "2", "--mirostat-ent", "2.0", "--mirostat-lr", "0.5"
    )
    assert r.returncode == 0, r.stderr
    with SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, n_threads=THREADS, n_max=3) as llm:
        kw = {"max_tokens": 24, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 5}
        direct = llm.create_completion(text, mirostat_mode=2, mirostat_tau=2.0, mirostat_eta=0.5, **kw)
        assert r.stdout == text + direct["choices"][0]["text"] + "\n"
        typical = run_generate("-p", text, "--temp", "1", "--seed", "5", "--typical", "0.5")
        assert typical.stdout == text + llm.create_completion(text, typical_p=0.5, **kw)["choices"][0]["text"] + "\n"
        assert typical.stdout != r.stdout
    bad = run_generate("-p", text, "--mirostat", "3")
    assert bad.returncode == 2 and "--mirostat" in bad.stderr


def test_batch_size_reaches_libllama() -> None:
    r = run_generate("-p", "def f(x):", "-b", "64", "--verbose")
    assert r.returncode == 0, r.stderr
    assert re.search(r"n_batch\s+= 64\b", r.stderr) and re.search(r"n_ubatch\s+= 64\b", r.stderr), r.stderr[-2000:]


def test_llama_server_spellings_and_lora_options() -> None:
    """llama-server's -md / --spec-draft-n-max / -devd open the same pair as ours (the options given last
    win); --lora-scaled at 0 is the adapter-free text, at 1 another, and a malformed one is refused."""
    from tinycode import lora_gguf

    text = prompts()[2]["text"]
    ours = run_generate("-p", text)
    theirs = run_generate("-md", str(drafter_gguf("f32")), "--spec-draft-n-max", "3", "-devd", "cpu", "-p", text)
    assert ours.returncode == theirs.returncode == 0, theirs.stderr
    assert theirs.stdout == ours.stdout
    lora = str(lora_gguf())
    assert run_generate("--lora-scaled", f"{lora}:0", "-p", text).stdout == ours.stdout
    adapted = run_generate("--lora", lora, "-p", text)
    assert adapted.returncode == 0 and adapted.stdout != ours.stdout, adapted.stderr
    bad = run_generate("--lora-scaled", lora, "-p", text)
    assert bad.returncode == 2 and "expected FNAME:SCALE" in bad.stderr, bad.stderr
