"""`dflash chat`: a conversation with the target in its chat template, as llama-cli's conversation mode
holds one: each message read from the standard input (a line; one ending in a backslash goes on to the
next), the reply streamed (its thinking dimmed), the speculative statistics after it."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from .speculative import SpeculativeLlama

COMMANDS = "/clear starts the conversation over, /exit (or the end of the input) ends it"


def converse(
    llm: SpeculativeLlama, first: str | None, system: str | None, single_turn: bool, options: dict[str, Any]
) -> None:
    """Hold the conversation: `first` the first message (else the first read), `options` the
    create_chat_completion arguments of every reply."""
    opening = [{"role": "system", "content": system}] if system else []
    interactive = sys.stdin.isatty()
    if interactive:
        click.echo(f"[dflash] {COMMANDS}", err=True)
    try:
        _converse(llm, opening, _messages(first, interactive), single_turn, options)
    except KeyboardInterrupt:  # Ctrl-C while a message is typed: the end
        click.echo()


def _converse(
    llm: SpeculativeLlama,
    opening: list[dict[str, Any]],
    texts: Iterator[str],
    single_turn: bool,
    options: dict[str, Any],
) -> None:
    messages = list(opening)
    for text in texts:
        command = text.strip()
        if command in ("/exit", "/quit"):
            return
        if command == "/clear":
            messages = list(opening)
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": text})
        try:
            messages.append({"role": "assistant", "content": _reply(llm, messages, options)})
        except (ValueError, RuntimeError) as e:  # e.g. the conversation no longer fits the context
            messages.pop()
            click.echo(f"dflash: error: {e} ({COMMANDS})", err=True)
            if single_turn:
                sys.exit(2)
            continue
        click.echo(f"[dflash] {llm.stats.line()}", err=True)
        if single_turn:
            return


def _messages(first: str | None, interactive: bool) -> Iterator[str]:
    if first is not None:
        yield first
    while True:
        lines: list[str] = []
        while True:
            if interactive:
                click.echo("> " if not lines else "  ", nl=False)
            line = sys.stdin.readline()
            if not line:  # the end of the input
                if lines:
                    yield "\n".join(lines)
                return
            line = line.rstrip("\n")
            if not line.endswith("\\"):
                lines.append(line)
                break
            lines.append(line[:-1])
        yield "\n".join(lines)


def _reply(llm: SpeculativeLlama, messages: list[dict[str, Any]], options: dict[str, Any]) -> str:
    """Stream the reply to `messages`; its text. Ctrl-C stops it where it is (what came is kept)."""
    chunks = llm.create_chat_completion(messages, stream=True, **options)
    content = ""
    try:
        for chunk in chunks:
            delta = chunk["choices"][0]["delta"]
            if delta.get("reasoning_content"):
                click.echo(click.style(delta["reasoning_content"], dim=True), nl=False)
            if delta.get("content"):
                content += delta["content"]
                click.echo(delta["content"], nl=False)
    except KeyboardInterrupt:
        chunks.close()  # type: ignore[union-attr]
    click.echo()
    return content
