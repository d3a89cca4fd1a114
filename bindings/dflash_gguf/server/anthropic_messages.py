"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens, which llama-server serves too:
what agents written for Claude, Claude Code among them, speak to a local model): a request becomes the chat
of the same turns, the reply a message object or the Messages stream's events."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from .reply_parts import Part, message_parts, prefilled, reply_steps
from .requests import BadRequest

# what a chat's finish_reason is called here
_STOP_REASON = {"length": "max_tokens", "tool_calls": "tool_use"}


def chat_body(body: Any, need_max_tokens: bool = True) -> dict[str, Any]:
    """The /v1/chat/completions body of a Messages request: `system` as a system message, each message's
    text, thinking, tool_use and tool_result blocks as the chat's content, reasoning, tool calls and tool
    messages, `tools` (input_schema) and `tool_choice` in the chat's shapes, stop_sequences as stop, thinking
    disabled as no thinking, enabled with its budget_tokens as the reasoning budget; max_tokens, temperature, top_p, top_k and stream as they are. BadRequest names
    what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if not isinstance(body.get("messages"), list):
        raise BadRequest("'messages' is required: an array of messages")
    limit = body.get("max_tokens")
    if need_max_tokens and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        # (a chat's 0 means "up to the end of the context")
        raise BadRequest(f"'max_tokens' is required: the most tokens to generate, >= 1, got {limit!r}")
    chat = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "stream") if k in body}
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        messages.append({"role": "system", "content": _joined(system, "system")})
    for m in body["messages"]:
        messages += _chat_messages(m)
    chat["messages"] = messages
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be an array")
        # Anthropic's server tools (web search, code execution, ...) run on Anthropic's side and have no local
        # equivalent: left out, so that an agent that offers them (Claude Code's web search) still gets its answer
        chat["tools"] = [_chat_tool(t) for t in tools if not isinstance(t, dict) or t.get("type", "custom") == "custom"]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "none"):
            chat["tool_choice"] = kind
        elif kind == "any":
            chat["tool_choice"] = "required"
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        chat["reasoning_effort"] = "none"  # the chat's "no thinking"
    elif isinstance(thinking, dict) and thinking.get("type") == "enabled":  # its budget (llama-server's default)
        chat["reasoning_budget_tokens"] = thinking.get("budget_tokens", 10000)
    return chat


def _joined(content: Any, what: str) -> str:
    """Text, or text blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text" for b in content):
        return "".join(str(b.get("text", "")) for b in content)
    raise BadRequest(f"{what} must be text or text blocks (text only), got {content!r:.80}")


def _chat_messages(m: Any) -> list[dict[str, Any]]:
    """One Messages message as chat messages: a tool message per tool_result block (they answer the calls of
    the turn before, so they come first), then the turn (text parts, reasoning, tool calls)."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise BadRequest(f"each message needs a role, user or assistant, got {m!r:.80}")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise BadRequest(f"a message's content must be text or an array of blocks, got {content!r:.80}")
    turn: dict[str, Any] = {"role": role}
    texts, calls, results, thought = [], [], [], ""
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append({"type": "text", "text": str(block.get("text", ""))})
        elif kind == "thinking":
            thought += str(block.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue  # encrypted thinking of another model: nothing a local one can read
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
            calls.append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {"name": block.get("name"), "arguments": arguments},
                }
            )
        elif kind == "tool_result":
            output = block.get("content", "")
            results.append(
                {"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": _joined(output, "a tool_result")}
            )
        else:
            raise BadRequest(
                f"content blocks must be text, thinking, tool_use or tool_result (text only), got {block!r:.80}"
            )
    if texts or calls or thought:
        turn["content"] = texts or ""
        if calls:
            turn["tool_calls"] = calls
        if thought:
            turn["reasoning_content"] = thought
        return [*results, turn]
    return results


def _chat_tool(tool: Any) -> dict[str, Any]:
    """A client tool ({"name", "description", "input_schema"}) in the chat's shape."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise BadRequest(f"a tool needs a name (and a description and an input_schema), got {tool!r:.80}")
    function = {
        "name": tool["name"],
        "description": tool.get("description", ""),
        "parameters": tool.get("input_schema", {}),
    }
    return {"type": "function", "function": function}


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": prompt_tokens - cached, "cache_read_input_tokens": cached, "output_tokens": output_tokens}


def _block(part: Part, complete: bool) -> dict[str, Any]:
    """A reply's part as a content block; at its start (not complete) without its text."""
    text = part.text if complete else ""
    if part.kind == "reasoning":
        return {"type": "thinking", "thinking": text, "signature": ""}  # a local model signs nothing
    if part.kind == "text":
        return {"type": "text", "text": text}
    arguments: Any = {}
    if complete:
        try:
            arguments = json.loads(part.text)
        except ValueError:
            arguments = {}
    return {"type": "tool_use", "id": part.call_id, "name": part.name, "input": arguments}


def _stop(reason: str, stop_sequence: str | None) -> dict[str, Any]:
    """stop_reason and stop_sequence of a chat that ended for `reason`; `stop_sequence`: the request's stop
    sequence that ended it, if one did."""
    if stop_sequence is not None:
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_sequence}
    return {"stop_reason": _STOP_REASON.get(reason, "end_turn"), "stop_sequence": None}


def _message(model: str, content: list[dict[str, Any]], stop: dict[str, Any], usage: dict[str, int]) -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": model,
        **stop,
        "usage": usage,
    }


def message_object(chat: dict[str, Any], stop_sequence: str | None) -> dict[str, Any]:
    """A chat completion as the message object; `stop_sequence`: the request's stop sequence that ended it."""
    choice, u = chat["choices"][0], chat["usage"]
    content = [_block(p, complete=True) for p in message_parts(choice["message"])]
    usage = _usage(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"])
    return _message(chat["model"], content, _stop(choice["finish_reason"], stop_sequence), usage)


def message_events(
    chunks: Iterator[dict[str, Any]],
    model: str,
    prompt: Callable[[], tuple[int, int]],
    usage: Callable[[], dict[str, Any]],
    stop_sequence: Callable[[], str | None],
) -> Iterator[dict[str, Any]]:
    """A chat stream as the Messages stream's events: message_start once the prompt is decoded (`prompt()`:
    its tokens and those reused, read then), each part's content_block_start, deltas and content_block_stop,
    then message_delta (the stop reason and the usage, `usage()`: the chat's, and `stop_sequence()`, read at
    the end) and message_stop."""
    chunks = prefilled(chunks)
    n_prompt, cached = prompt()
    no_stop = {"stop_reason": None, "stop_sequence": None}
    yield {"type": "message_start", "message": _message(model, [], no_stop, _usage(n_prompt, cached, 0))}
    index = -1
    for step in reply_steps(chunks):
        part = step.part
        if step.action == "open":
            index += 1
            yield {"type": "content_block_start", "index": index, "content_block": _block(part, complete=False)}
        elif step.action == "delta":
            key, name = _DELTA[part.kind]
            yield {"type": "content_block_delta", "index": index, "delta": {"type": name, key: step.delta}}
        elif step.action == "close":
            if part.kind == "reasoning":  # a thinking block is signed before it closes
                signature = {"type": "signature_delta", "signature": ""}
                yield {"type": "content_block_delta", "index": index, "delta": signature}
            yield {"type": "content_block_stop", "index": index}
        else:
            u = usage()
            counts = _usage(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], u["completion_tokens"])
            delta = _stop(step.reason, stop_sequence())
            yield {"type": "message_delta", "delta": delta, "usage": counts}
            yield {"type": "message_stop"}


# a part's deltas: the field and the delta type
_DELTA = {
    "reasoning": ("thinking", "thinking_delta"),
    "text": ("text", "text_delta"),
    "call": ("partial_json", "input_json_delta"),
}
