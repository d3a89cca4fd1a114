"""A chat template rendered as llama-server renders it (with llama_cpp's jinja2 environment): only the
arguments a request has, and a system message joined to the next where the template takes none."""

from __future__ import annotations

import functools
from typing import Any

from llama_cpp import llama_chat_format


@functools.lru_cache(maxsize=4)
def formatter(template: str, eos: str, bos: str) -> TemplateFormatter:
    """A template's renderer, compiled once."""
    return TemplateFormatter(template=template, eos_token=eos, bos_token=bos)


@functools.lru_cache(maxsize=4)
def takes_system(template: str) -> bool:
    """`template` renders a system message (llama-server's probe: its text is in the prompt; Gemma's
    templates refuse one)."""
    probe = [{"role": "system", "content": "System message"}, {"role": "user", "content": "User message"}]
    try:
        return "System message" in formatter(template, "", "")(messages=probe).prompt
    except Exception:  # noqa: BLE001 - refused (raise_exception) or unrenderable
        return False


def check_template(template: str) -> None:
    """A ValueError naming what is wrong where `template` is no Jinja template."""
    import jinja2

    try:
        formatter(template, "", "")
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template: line {getattr(e, 'lineno', '?')}: {e}") from e


def without_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages for a template that takes no system message, as llama-server hands them to it: the
    system text joins the next message's, or goes where none follows."""
    system, rest = messages[0], messages[1:]
    if not rest:
        return rest
    return [{**rest[0], "content": f"{system.get('content') or ''}\n{rest[0].get('content') or ''}"}, *rest[1:]]


class TemplateFormatter(llama_chat_format.Jinja2ChatFormatter):
    """llama_cpp's chat template renderer, given only the arguments a request has: llama-server leaves out
    `tools` (and the rest) when there are none, where llama_cpp's passes None, which templates that test
    `tools is defined` and then walk them (Hermes 3's) cannot iterate."""

    def __call__(self, *, messages: Any, add_generation_prompt: bool = True, **kwargs: Any) -> Any:  # type: ignore[override]
        def raise_exception(message: str) -> None:
            raise ValueError(message)

        prompt = self._environment.render(
            messages=messages,
            eos_token=self.eos_token,
            bos_token=self.bos_token,
            raise_exception=raise_exception,
            add_generation_prompt=add_generation_prompt,
            strftime_now=self.strftime_now,
            **kwargs,
        )
        return llama_chat_format.ChatFormatterResponse(prompt=prompt, stop=[self.eos_token], added_special=True)
