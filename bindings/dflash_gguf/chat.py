"""Chats: messages through the target's chat template, replies taken apart (reasoning, tool calls) in
llama-server's and OpenAI's shapes."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from .call_grammars import tool_call_grammar
from .chat_reply import reply_markers, reply_message, reply_parser, reply_syntax, thinking_tags
from .chat_template import formatter, takes_system, without_system
from .generation import zero_is_no_limit
from .llama_compat import (
    LogprobCursor,
    chat_logprobs,
    check_logprobs,
    forced_tool,
    response_format_grammar,
    tool_functions,
)
from .sampling import ReasoningBudget


class ChatMixin:
    """SpeculativeLlama's create_chat_completion and apply_chat_template, on its completions."""

    def create_chat_completion(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int | None = None,
        temperature: float = 0.2,
        top_p: float = 0.95,
        top_k: int = 40,
        min_p: float = 0.05,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        stream: bool = False,
        repeat_penalty: float = 1.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        model: str | None = None,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        grammar: Any = None,
        logits_processor: Callable[[Any, Any], Any] | None = None,
        response_format: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        functions: list[dict[str, Any]] | None = None,
        function_call: str | dict[str, Any] | None = None,
        typical_p: float = 1.0,
        mirostat_mode: int = 0,
        mirostat_tau: float = 5.0,
        mirostat_eta: float = 0.1,
        tfs_z: float = 1.0,  # ignored, as in create_completion
        reasoning_format: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        reasoning_budget_tokens: int | None = None,
        reasoning_budget_message: str | None = None,
        reasoning_control: bool = False,
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """Chat with the target GGUF's chat template (ChatML when it has none), as llama_cpp.Llama's
        template-based chat handlers do. `grammar` and `logits_processor` as in create_completion.
        `response_format={"type": "json_object"}` (with "schema": a JSON schema; or OpenAI's
        {"type": "json_schema", "json_schema": {"schema": ...}}) constrains the reply to JSON through a
        grammar. `tools` (and the legacy `functions`) reach the chat template; a `tool_choice` naming one
        of them (`{"type": "function", "function": {"name": ...}}`) forces a call: its arguments follow
        the function's parameter schema and come back as `tool_calls` with finish_reason "tool_calls";
        `tool_choice="required"` forces a call to one of them (named by the model; streamed as one
        delta at the end). With tools and tool_choice "auto" (or none given) the model may call them in
        its template's own syntax, as llama-server reads it (Qwen2.5/Qwen3/Hermes `<tool_call>` JSON,
        Mistral Nemo's `[TOOL_CALLS]` list, Qwen3-Coder's and Qwen3.5's XML and gpt-oss's messages to a
        tool, each kept to the tools' schemas by a grammar that starts at the call's opening word; Llama
        3.x's closing JSON object; Muse Glimmer's messages to a tool): the calls come back as `tool_calls`
        (finish_reason "tool_calls"; streamed as they are written), the text around them as content;
        `parallel_tool_calls=False` (OpenAI's) holds the reply to one call.
        `reasoning_format="deepseek"` (llama-server's default): a reasoning model's `<think>...</think>`
        comes back as `reasoning_content`, apart from the content, and the reply is read as llama-server
        reads it ("none": the same, its thinking left in the content); None (the default, as
        llama_cpp.Llama): the reply as written, its tool calls aside (gpt-oss's and Muse Glimmer's replies
        are read as under "none").
        `chat_template_kwargs` reach the template (e.g. {"enable_thinking": False} for Qwen3).
        `reasoning_budget_tokens=N` (llama-server's --reasoning-budget): once a reasoning model has thought N
        tokens, the end of its thinking is written for it (`reasoning_budget_message`, then the closing tag)
        and it goes on to the answer; 0 ends the thinking at once; None or -1: no budget.
        `reasoning_control=True` (llama-server's): `end_reasoning()`, called from another thread while the
        reply streams, ends its thinking so (the budget's message then too). The reply's id is
        `self.completion_id` from the call on.
        `logprobs=True` (with `top_logprobs=n`): the reply's tokens' log-probabilities in OpenAI's shape.
        Sampling options as in create_completion."""
        n_logprobs = (top_logprobs or 0) if logprobs else None
        check_logprobs(n_logprobs)
        named = tool_functions(tools, functions)
        call = forced_tool(named, tool_choice, function_call)
        may_call = call is None and bool(named) and "none" not in (tool_choice, function_call)
        model_name = model if model is not None else self.model_path
        template_args = template_arguments(tools, tool_choice, functions, function_call, chat_template_kwargs)
        prompt, template_stops = self._format_chat(messages, template_args)
        syntax = reply_syntax(self.chat_template, prompt, reasoning_format, may_call)
        lazy = tool_call_grammar(named, syntax, parallel_tool_calls) if may_call else None
        grammars = {
            "grammar": grammar,
            "response_format": response_format_grammar(response_format),
            "tool_choice": call.grammar if call is not None else None,
        }
        given = [k for k, g in grammars.items() if g is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} each constrain the reply with a grammar: give one of them")
        triggers: tuple[str, ...] = ()
        if lazy is not None and not given:  # a grammar of the caller's own wins over the tools'
            grammars["tools"], triggers = lazy
            given = ["tools"]
        stops = ([stop] if isinstance(stop, str) else list(stop or [])) + template_stops
        reasoning = self._reasoning_budget(
            messages,
            template_args,
            prompt,
            reasoning_budget_tokens,
            reasoning_budget_message,
            bool(triggers) or reasoning_control,
        )
        sampling = self._sampling(max_tokens, grammars[given[0]] if given else None, locals(), triggers, reasoning)
        cid, created = f"chatcmpl-{uuid.uuid4()}", int(time.time())
        self.completion_id = cid
        markers = (self.tokenize(m.encode(), add_bos=False, special=True) for m in reply_markers(syntax))
        shown = frozenset(ids[0] for ids in markers if len(ids) == 1)  # the markers that are a token each
        chunks = self._completion_chunks(
            prompt, zero_is_no_limit(max_tokens), sampling, stops, seed, n_logprobs, shown=shown
        )
        cursor = None
        if n_logprobs is not None:
            cursor = LogprobCursor(self._completion_tokens, self._token_logprobs, self._spec.token_to_piece, 0)
        fingerprint = self.system_fingerprint
        # a forced call's grammar makes the whole reply the call: nothing to take apart
        parser = reply_parser(syntax, named if may_call else {}) if call is None and syntax.parses else None

        def finish(reason: str | None, content: str) -> str | None:
            if reason != "stop":
                return reason
            called = call.call(content) if call is not None else parser is not None and parser.calls
            return "tool_calls" if called else reason

        def deltas(text: str, reason: str | None, content: str) -> list[dict[str, Any]]:
            """The chat deltas of the reply's text so far (`content`), of which `text` is new."""
            if parser is not None:
                return parser.feed(text) + (parser.finish() if reason else [])
            if call is not None and call.name is None:  # a call to any tool: named at the end
                text = content if reason else ""
            if not text:
                return []
            return [call.delta(text) if call else {"content": text}]

        if stream:

            def gen() -> Iterator[dict[str, Any]]:
                def chunk(delta: dict[str, Any], lp: dict[str, Any] | None, reason: str | None) -> dict[str, Any]:
                    return {
                        "id": cid,
                        "object": "chat.completion.chunk",
                        "created": created,
                        "model": model_name,
                        "system_fingerprint": fingerprint,
                        "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}],
                    }

                yield chunk({"role": "assistant"}, None, None)
                content = ""
                for text, reason in chunks:
                    content += text
                    for i, delta in enumerate(deltas(text, reason, content)):
                        lp = chat_logprobs(cursor.take(len(content))) if cursor is not None and i == 0 else None
                        yield chunk(delta, lp, None)
                    if reason:
                        yield chunk({}, None, finish(reason, content))

            return gen()
        parts, reason = [], None
        for text, reason in chunks:
            parts.append(text)
        content = "".join(parts)
        reply_logprobs = chat_logprobs(cursor.take(len(content))) if cursor is not None else None
        if parser is not None:
            message = reply_message(parser.feed(content) + parser.finish())
        else:
            message = call.message(content) if call else {"role": "assistant", "content": content}
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "system_fingerprint": fingerprint,
            "choices": [
                {"index": 0, "message": message, "logprobs": reply_logprobs, "finish_reason": finish(reason, content)}
            ],
            "usage": self.stats.usage(),
        }

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text create_chat_completion makes of these messages (llama-server's /apply-template)."""
        return self._format_chat(messages, template_arguments(tools, None, None, None, chat_template_kwargs))[0]

    def _reasoning_budget(
        self,
        messages: list[dict[str, Any]],
        template_args: dict[str, Any],
        prompt: str,
        tokens: int | None,
        message: str | None,
        armed: bool,
    ) -> ReasoningBudget | None:
        """llama-server's reasoning budget for a chat whose prompt is `prompt`: where the template thinks and
        there is a budget, or (`armed`) a lazy grammar to hold back while the model thinks or an end of the
        thinking to force on request."""
        budget = -1 if tokens is None else tokens
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < -1:
            raise ValueError(f"reasoning_budget_tokens must be an int >= 0 (-1 or None: no budget), got {tokens!r}")
        if message is not None and not isinstance(message, str):
            raise ValueError(f"reasoning_budget_message must be text, got {message!r:.80}")
        tags = thinking_tags(self.chat_template or "")
        if tags is None or (budget < 0 and not armed):
            return None
        # the template's opening of the reply (llama-server's generation prompt): what rendering the
        # conversation without it leaves out
        bare = self._format_chat(messages, template_args, add_generation_prompt=False)[0]
        opening = prompt[len(os.path.commonprefix([prompt, bare])) :]

        def ids(text: str) -> tuple[int, ...]:
            return tuple(self.tokenize(text.encode(), add_bos=False, special=True)) if text else ()

        opened = ids(opening)
        # as llama-server: a space some tokenizers put before a first special token is not the opening's
        if opened and opening[:1].strip() and self._spec.token_to_piece(opened[0], True)[:1].isspace():
            opened = opened[1:]
        start, ends = tags
        closing = tuple(ids(end) for end in ends)
        return ReasoningBudget(budget, ids(start), closing, ids(message or "") + closing[0], opened)

    def _format_chat(
        self,
        messages: list[dict[str, Any]],
        template_args: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> tuple[str, list[str]]:
        import jinja2

        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        template = self.chat_template
        messages = [replayed_call(as_template_message(m), "arguments|items" in (template or "")) for m in messages]
        try:
            if template:
                eos, bos = (
                    self._spec.token_to_piece(t, True).decode("utf-8", "replace") if t >= 0 else ""
                    for t in (self._spec.token_eos, self._spec.token_bos)
                )
                if messages and messages[0].get("role") == "system" and not takes_system(template):
                    messages = without_system(messages)
                resp = formatter(template, eos, bos)(
                    messages=messages, add_generation_prompt=add_generation_prompt, **(template_args or {})
                )
                if bos and self._spec.add_bos and resp.prompt.startswith(bos):  # tokenizing adds it back
                    resp.prompt = resp.prompt[len(bos) :]
            else:
                resp = chatml(messages)
        except (KeyError, TypeError, AttributeError, jinja2.TemplateError) as e:  # a message the template rejects
            raise ValueError(
                f"the messages do not fit the chat template ({type(e).__name__}: {e}); each "
                "needs a 'role' and a 'content'"
            ) from e
        stop = resp.stop if isinstance(resp.stop, list) else ([resp.stop] if resp.stop else [])
        return resp.prompt, stop


def template_arguments(
    tools: Any, tool_choice: Any, functions: Any, function_call: Any, chat_template_kwargs: Any
) -> dict[str, Any]:
    """What a chat template is rendered with besides the messages."""
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict, got {chat_template_kwargs!r:.80}")
    # llama-server's: today's date (Llama 3.x templates print it), and no `tools` at all rather than none
    # (templates that test `tools is defined` then walk them)
    args: dict[str, Any] = {"date_string": time.strftime("%d %b %Y"), "datetime": time.strftime("%b %d %Y")}
    given = {"tools": tools or None, "tool_choice": tool_choice, "functions": functions, "function_call": function_call}
    args |= {k: v for k, v in given.items() if v is not None}
    return args | (chat_template_kwargs or {})


def as_template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as llama-server hands it to a chat template: the `developer` role (OpenAI's newer name)
    as `system`, and content given as a list of parts as their texts joined by newlines."""
    out = dict(message)
    if out.get("role") == "developer":
        out["role"] = "system"
    content = out.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(
                    f"message content parts must be {{'type': 'text', 'text': ...}} (text only), "
                    f"got a part of type {kind!r}"
                )
            texts.append(part["text"])
        out["content"] = "\n".join(texts)
    return out


def chatml(messages: list[dict[str, Any]]) -> Any:
    """llama-server's ChatML for a model without a chat template: every message as
    <|im_start|>role\ncontent<|im_end|>\n, then the assistant's turn opened (no system turn of its own)."""
    from llama_cpp.llama_chat_format import ChatFormatterResponse

    for m in messages:  # a KeyError for a message without content, as templates raise it
        if not isinstance(m["content"], (str, type(None))):
            raise ValueError(f"a message's content must be text, got {m['content']!r:.80}")
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content'] or ''}<|im_end|>\n" for m in messages)
    return ChatFormatterResponse(prompt=turns + "<|im_start|>assistant\n", stop=["<|im_end|>"])


def replayed_call(message: dict[str, Any], object_arguments: bool) -> dict[str, Any]:
    """An assistant message with tool_calls, as chat templates read it (llama-server's rules): its null
    content (OpenAI's) as "", and for templates that walk the arguments (Qwen3-Coder's), the calls'
    JSON argument strings as objects."""
    if message.get("role") != "assistant" or not message.get("tool_calls"):
        return message
    message = {**message, "content": message.get("content") or ""}
    if object_arguments:
        calls = []
        for c in message["tool_calls"]:
            args = c.get("function", {}).get("arguments") if isinstance(c, dict) else None
            if isinstance(args, str):
                try:
                    c = {**c, "function": {**c["function"], "arguments": json.loads(args)}}
                except ValueError as e:
                    raise ValueError(f"a tool call's arguments are not JSON: {args!r:.80}") from e
            calls.append(c)
        message["tool_calls"] = calls
    return message
