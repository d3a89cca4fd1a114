"""OpenAI's Responses API (POST /v1/responses, which llama-server serves too): a request is a chat told in
other words, so it becomes a /v1/chat/completions body, and the chat's result or stream becomes a response
object or the Responses stream's events. Responses are not stored (no previous_response_id): a client sends
the conversation in `input`, as with chats."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from .reply_parts import Part, message_parts, prefilled, reply_steps
from .requests import BadRequest

# Responses fields that have another name (or shape) in a chat request
_RENAMED = {"input", "instructions", "tools", "tool_choice", "max_output_tokens", "text", "reasoning"}


def chat_body(body: Any) -> dict[str, Any]:
    """The /v1/chat/completions body of a Responses request: `instructions` as a system message, `input` (text,
    or items: messages, function calls and their outputs, reasoning) as the messages, function tools in the
    chat's shape, max_output_tokens, text.format and reasoning.effort under the chat's names; the sampling
    fields as they are. BadRequest names what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if "input" not in body:
        raise BadRequest("'input' is required")
    if body.get("previous_response_id"):
        raise BadRequest(
            "previous_response_id is not supported (responses are not stored): send the whole conversation in 'input'"
        )
    chat = {k: v for k, v in body.items() if k not in _RENAMED}
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        messages.append({"role": "system", "content": _text(instructions, "instructions")})
    given = body["input"]
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for item in given:
            _add_item(messages, item)
    else:
        raise BadRequest("'input' must be text or an array of items")
    chat["messages"] = messages
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be an array")
        # the hosted tools (web search, file search, a shell, ...) have no chat equivalent: left out, as
        # llama-server leaves them out, so that an agent that offers them still gets its answer
        chat["tools"] = [_chat_tool(t) for t in tools if not isinstance(t, dict) or t.get("type") == "function"]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):  # {"type": "function", "name": ...}: the chat names it under "function"
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    limit = body.get("max_output_tokens")
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:  # a chat's 0 means no limit
            raise BadRequest(f"'max_output_tokens' must be an integer >= 1, got {limit!r}")
        chat["max_tokens"] = limit
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    return chat


def _text(content: Any, what: str, kinds: tuple[str, ...] = ("input_text",)) -> Any:
    """Message content as the chat takes it: text, or a list of its text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{what} must be text or an array of content parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise BadRequest(
                f"{what}: content parts must be {' or '.join(kinds)} with text (text only), got {part!r:.80}"
            )
        parts.append({"type": "text", "text": part["text"]})
    return parts


def _add_item(messages: list[dict[str, Any]], item: Any) -> None:
    """One input item as chat messages; what the model said (its messages, function calls, reasoning) joins
    the assistant message before it, as one turn."""
    if not isinstance(item, dict):
        raise BadRequest(f"each input item must be an object, got {item!r:.80}")
    kind, role = item.get("type", "message"), item.get("role")
    previous = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if kind == "message" and role in ("user", "system", "developer"):
        messages.append({"role": role, "content": _text(item.get("content"), f"a {role} message")})
    elif kind == "message" and role == "assistant":
        content = _text(item.get("content"), "an assistant message", ("output_text", "input_text"))
        if previous is None:
            messages.append({"role": "assistant", "content": content})
        else:
            previous["content"] = _parts(previous.get("content")) + _parts(content)
    elif kind == "function_call":
        if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            raise BadRequest(f"a function_call item needs call_id, name and arguments, got {item!r:.80}")
        call = {
            "id": item["call_id"],
            "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]},
        }
        if previous is None:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            previous.setdefault("tool_calls", []).append(call)
    elif kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise BadRequest(f"a function_call_output item needs a call_id, got {item!r:.80}")
        output = _text(item.get("output"), "a function_call_output")
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
    elif kind == "reasoning":
        texts = [p.get("text") for p in item.get("content") or item.get("summary") or [] if isinstance(p, dict)]
        thought = "".join(t for t in texts if isinstance(t, str))
        if previous is None:
            messages.append({"role": "assistant", "content": "", "reasoning_content": thought})
        else:
            previous["reasoning_content"] = thought
    else:
        raise BadRequest(
            f"input items must be messages, function_call, function_call_output or reasoning, got {item!r:.80}"
        )


def _parts(content: Any) -> list[dict[str, Any]]:
    if not content:
        return []
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def _chat_tool(tool: Any) -> dict[str, Any]:
    """A Responses function tool ({"type": "function", "name", "description", "parameters"}) in the chat's
    shape."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise BadRequest(f"a function tool needs a name, got {tool!r:.80}")
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "output_tokens": chat_usage["completion_tokens"],
        "total_tokens": chat_usage["total_tokens"],
        "input_tokens_details": dict(chat_usage["prompt_tokens_details"]),
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Response:
    """The response object of one request, as it stands: its id and times, its output items."""

    def __init__(self, model: str) -> None:
        self.id, self.created, self.model = _new_id("resp"), int(time.time()), model

    def shape(self, output: list[dict[str, Any]], finish: str | None, usage: dict[str, Any] | None) -> dict[str, Any]:
        """The object, in progress until `finish` (the chat's finish_reason) is known; a reply cut at
        max_output_tokens is "incomplete", as OpenAI's."""
        cut = finish == "length"
        status = "in_progress" if finish is None else "incomplete" if cut else "completed"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "error": None,
            "usage": usage,
        }


def _item(part: Part, item_id: str, status: str) -> dict[str, Any]:
    """A reply's part as the Responses output item; an open one (status "in_progress") without its text."""
    text = part.text if status == "completed" else ""
    if part.kind == "reasoning":
        content = [{"type": "reasoning_text", "text": text}] if text else []
        return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}
    if part.kind == "text":
        content = [] if status != "completed" else [_text_part(text)]
        return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": part.call_id,
        "name": part.name,
        "arguments": text,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


_PREFIX = {"reasoning": "rs", "text": "msg", "call": "fc"}


def response_object(chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion as the response object."""
    choice = chat["choices"][0]
    items = [_item(p, _new_id(_PREFIX[p.kind]), "completed") for p in message_parts(choice["message"])]
    return _Response(chat["model"]).shape(items, choice["finish_reason"], _usage(chat["usage"]))


def response_events(
    chunks: Iterator[dict[str, Any]], model: str, usage: Callable[[], dict[str, Any]]
) -> Iterator[dict[str, Any]]:
    """A chat stream as the Responses stream's events: response.created and .in_progress once the prompt is
    decoded, then per output item (reasoning, the message, each function call) its .added, its deltas and
    its .done events, then response.completed (.incomplete for a reply cut at max_output_tokens) with the
    whole response and its usage (`usage()`: the chat's, read at the end)."""
    response = _Response(model)
    seq = itertools.count()

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(seq), **fields}

    chunks = prefilled(chunks)
    yield event("response.created", response=response.shape([], None, None))
    yield event("response.in_progress", response=response.shape([], None, None))
    done: list[dict[str, Any]] = []  # the items completed
    item_id = ""  # the open item's
    for step in reply_steps(chunks):
        part, at = step.part, len(done)
        if step.action == "finish":
            kind = "response.incomplete" if step.reason == "length" else "response.completed"
            yield event(kind, response=response.shape(done, step.reason, _usage(usage())))
        elif step.action == "open":
            item_id = _new_id(_PREFIX[part.kind])
            yield event("response.output_item.added", output_index=at, item=_item(part, item_id, "in_progress"))
            if part.kind == "text":
                where = {"item_id": item_id, "output_index": at, "content_index": 0}
                yield event("response.content_part.added", **where, part=_text_part(""))
        elif step.action == "delta":
            if part.kind == "call":
                yield event(
                    "response.function_call_arguments.delta", item_id=item_id, output_index=at, delta=step.delta
                )
            else:
                kind = "response.reasoning_text.delta" if part.kind == "reasoning" else "response.output_text.delta"
                extra = {"logprobs": []} if part.kind == "text" else {}
                yield event(kind, item_id=item_id, output_index=at, content_index=0, delta=step.delta, **extra)
        else:  # close
            where = {"item_id": item_id, "output_index": at}
            if part.kind == "text":
                yield event("response.output_text.done", **where, content_index=0, text=part.text, logprobs=[])
                yield event("response.content_part.done", **where, content_index=0, part=_text_part(part.text))
            elif part.kind == "reasoning":
                yield event("response.reasoning_text.done", **where, content_index=0, text=part.text)
            else:
                yield event("response.function_call_arguments.done", **where, name=part.name, arguments=part.text)
            item = _item(part, item_id, "completed")
            yield event("response.output_item.done", output_index=at, item=item)
            done.append(item)
