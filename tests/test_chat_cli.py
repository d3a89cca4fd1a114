"""`dflash chat`: a conversation held as the Python API holds it (each reply the one create_chat_completion
gives the messages so far), commands, a system prompt, one turn, a message that does not fit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
from tinycode import N_CTX, TARGET, THREADS, drafter_gguf  # noqa: E402

from dflash_gguf import SpeculativeLlama  # noqa: E402

GREEDY = {"temperature": 0.0, "max_tokens": 16}


def run_chat(stdin: str, *args: str, ctx: int = N_CTX) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "dflash_gguf.cli", "chat", "-m", str(TARGET), "-d", str(drafter_gguf("f32"))]
    cmd += ["-c", str(ctx), "-t", str(THREADS), "-n", "16", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def llm() -> SpeculativeLlama:
    return SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, n_threads=THREADS)


def reply(llm: SpeculativeLlama, messages: list[dict[str, str]]) -> str:
    return str(llm.create_chat_completion(messages, **GREEDY)["choices"][0]["message"]["content"])


def test_a_conversation_is_the_api_s(llm: SpeculativeLlama) -> None:
    """Each reply is the API's to the conversation so far (the earlier replies in it); /clear starts over;
    a line ending in a backslash goes on to the next; the statistics follow each reply."""
    out = run_chat("class Foo:\n    def bar(self):\n/clear\n\nhi \\\nthere\n/exit\nnot read\n")
    assert out.returncode == 0, out.stderr
    first = [{"role": "user", "content": "class Foo:"}]
    second = {"role": "user", "content": "    def bar(self):"}
    r1 = reply(llm, first)
    r2 = reply(llm, [*first, {"role": "assistant", "content": r1}, second])
    r3 = reply(llm, [{"role": "user", "content": "hi \nthere"}])
    assert out.stdout == f"{r1}\n{r2}\n{r3}\n"
    assert r2 != reply(llm, [second])  # the history made a difference
    assert [line.startswith("[dflash] 16 tokens") for line in out.stderr.splitlines()] == [True] * 3, out.stderr


def test_a_system_prompt_and_a_single_turn(llm: SpeculativeLlama) -> None:
    out = run_chat("never read\n", "-sys", "You write Python.", "-p", "def main", "--single-turn")
    assert out.returncode == 0, out.stderr
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def main"}]
    assert out.stdout == reply(llm, messages) + "\n"


def test_a_message_that_does_not_fit_is_refused_and_the_chat_goes_on(llm: SpeculativeLlama) -> None:
    out = run_chat("word " * 400 + "\ndef main\n", ctx=256)
    assert out.returncode == 0, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("dflash: error:")]
    assert len(errors) == 1 and "/clear" in errors[0], out.stderr
    assert out.stdout == reply(llm, [{"role": "user", "content": "def main"}]) + "\n"
    single = run_chat("", "-p", "word " * 400, "-st", ctx=256)
    assert single.returncode == 2 and single.stdout == "", single.stderr


def test_a_chat_template_file(tmp_path: Path) -> None:
    """--chat-template-file: the conversation in that template (the reply the API gives with it); a file
    that cannot be read or compiled is a one-line error naming it."""
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    f = tmp_path / "tagged.jinja"
    f.write_text(template)
    out = run_chat("import os\n", "--chat-template-file", str(f))
    assert out.returncode == 0, out.stderr
    with SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, chat_template=template) as tagged:
        assert out.stdout == reply(tagged, [{"role": "user", "content": "import os"}]) + "\n"
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if %}")
    for bad, why in ((tmp_path / "missing.jinja", f"{tmp_path / 'missing.jinja'}: cannot read"), (broken, "line 1")):
        r = run_chat("x\n", "--chat-template-file", str(bad))
        assert r.returncode == 2 and r.stderr.startswith("dflash: error:") and why in r.stderr, r.stderr


def test_a_reasoning_budget(tmp_path: Path) -> None:
    """--reasoning-budget / --reasoning-budget-message: the thinking the template opens ends where the API's
    budget ends it (the reply as the API gives it, its thinking left in the text)."""
    template = (
        "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]\n<think>\n{% endif %}"
    )
    f = tmp_path / "thinking.jinja"
    f.write_text(template)
    budget = ("--reasoning-budget", "3", "--reasoning-budget-message", " ok")
    out = run_chat("import os\n", "--chat-template-file", str(f), "--reasoning-format", "none", *budget)
    assert out.returncode == 0, out.stderr
    with SpeculativeLlama(str(TARGET), str(drafter_gguf("f32")), n_ctx=N_CTX, chat_template=template) as thinking:
        message = thinking.create_chat_completion(
            [{"role": "user", "content": "import os"}],
            reasoning_format="none",
            reasoning_budget_tokens=3,
            reasoning_budget_message=" ok",
            **GREEDY,
        )["choices"][0]["message"]
    assert " ok</think>" in message["content"]
    assert out.stdout == message["content"] + "\n"
