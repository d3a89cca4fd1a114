"""Requests: the fields each route takes, checked and turned into SpeculativeLlama arguments."""

from __future__ import annotations

import math
from typing import Any

from ..speculative import SpeculativeLlama

# request fields passed on (anything else an OpenAI client sends, e.g. "user" or "stream_options", is
# ignored, as llama-server does)
COMMON = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "stream",
    "repeat_penalty",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "logprobs",
    "grammar",
    "typical_p",
    "tfs_z",
    "mirostat_mode",
    "mirostat_tau",
    "mirostat_eta",
}
FIELDS = {
    "/v1/completions": ("create_completion", "prompt", COMMON | {"echo", "suffix"}),
    "/apply-template": ("apply_chat_template", "messages", {"tools", "chat_template_kwargs"}),
    "/v1/chat/completions": (
        "create_chat_completion",
        "messages",
        COMMON
        | {
            "top_logprobs",
            "response_format",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "functions",
            "function_call",
            "reasoning_format",
            "chat_template_kwargs",
            "reasoning_budget_tokens",
            "reasoning_budget_message",
            "reasoning_control",
        },
    ),
}


class BadRequest(ValueError):
    pass


def request_kwargs(
    path: str,
    body: Any,
    reasoning_format: str = "deepseek",
    template_kwargs: dict[str, Any] | None = None,
    reasoning_budget: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The create_* keyword arguments of a request body; BadRequest names what is wrong. A chat's
    reasoning_format is the server's unless the request names one, its chat_template_kwargs the server's
    `template_kwargs` with the request's over them, its reasoning budget (reasoning_budget_tokens, or
    thinking_budget_tokens; -1 or none given: the server's) and reasoning_budget_message the server's
    `reasoning_budget` unless it names them (llama-server's rules)."""
    _, required, fields = FIELDS[path]
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if required not in body:
        raise BadRequest(f"'{required}' is required")
    if body.get("n", 1) != 1:
        raise BadRequest("only n = 1 is supported")
    kw = {k: v for k, v in body.items() if k in fields or k == required}
    # OpenAI's newer name, and llama-server's
    for theirs, ours in (("max_completion_tokens", "max_tokens"), ("mirostat", "mirostat_mode")):
        if theirs in body and ours not in body:
            kw[ours] = body[theirs]
    if path == "/v1/chat/completions":
        kw.setdefault("reasoning_format", reasoning_format)
        tokens = body.get("reasoning_budget_tokens", body.get("thinking_budget_tokens", -1))
        kw.pop("reasoning_budget_tokens", None)
        for key, value in (reasoning_budget or {}).items():
            kw.setdefault(key, value)
        if tokens != -1:
            kw["reasoning_budget_tokens"] = tokens
    if path in ("/v1/chat/completions", "/apply-template"):  # llama-server's rules for the template's inputs
        kwargs = kw.get("chat_template_kwargs", {})
        if not isinstance(kwargs, dict):
            raise BadRequest("chat_template_kwargs must be a JSON object")
        kwargs = kw["chat_template_kwargs"] = {"enable_thinking": True, **(template_kwargs or {}), **kwargs}
        if body.get("reasoning_effort") == "none":  # OpenAI's "no thinking", over the rest
            kwargs["enable_thinking"] = False
        if isinstance(kw.get("tools"), list):  # the template sees each tool as llama-server rebuilds it
            kw["tools"] = [template_tool(t) for t in kw["tools"]]
    bias = kw.get("logit_bias")
    if bias is not None:  # JSON object keys are strings
        try:
            kw["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (AttributeError, TypeError, ValueError):
            raise BadRequest("logit_bias must map token ids to numbers") from None
    return kw


def template_tool(tool: Any) -> Any:
    """A request's tool as llama-server hands it to the chat template: name, description ("" when
    absent) and parameters, in that order."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise BadRequest(f"each tool must be {{'type': 'function', 'function': {{'name': ...}}}}, got {tool!r:.80}")
    f = tool["function"]
    if not isinstance(f.get("name"), str):
        raise BadRequest(f"a tool's function needs a 'name', got {f!r:.80}")
    return {
        "type": "function",
        "function": {"name": f["name"], "description": f.get("description", ""), "parameters": f.get("parameters", {})},
    }


# llama-server's native routes (/completion, /infill: the format editor plugins such as llama.vim and
# llama.vscode speak): its field names for the sampling options create_completion takes
NATIVE_FIELDS = {
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "typical_p",
    "seed",
    "stop",
    "repeat_penalty",
    "frequency_penalty",
    "presence_penalty",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "grammar",
    "stream",
}


def native_kwargs(body: Any, required: tuple[str, ...]) -> dict[str, Any]:
    """create_completion's keyword arguments of a native request body (llama-server's names: n_predict,
    mirostat, ...); BadRequest names what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for name in required:
        if name not in body:
            raise BadRequest(f'"{name}" is required')
    n_predict = body.get("n_predict", -1)
    if isinstance(n_predict, bool) or not isinstance(n_predict, int):
        raise BadRequest(f'"n_predict" must be an integer (-1: until the end of the text), got {n_predict!r}')
    kw = {k: v for k, v in body.items() if k in NATIVE_FIELDS}
    n_probs = body.get("n_probs", 0)
    if isinstance(n_probs, bool) or not isinstance(n_probs, int) or n_probs < 0:
        raise BadRequest(f'"n_probs" must be an integer >= 0, got {n_probs!r}')
    if n_probs:  # the generation records what the route's completion_probabilities list
        kw["logprobs"] = n_probs
    if "mirostat" in kw:
        kw["mirostat_mode"] = kw.pop("mirostat")
    kw["max_tokens"] = None if n_predict < 0 else n_predict
    return kw


def no_end_of_text(llm: SpeculativeLlama) -> dict[int, float]:
    """llama-server's ignore_eos: every end-of-generation token's logit at -inf."""
    return dict.fromkeys(llm._spec.eog_tokens, -math.inf)


def completion_request(llm: SpeculativeLlama, body: Any) -> tuple[list[int], dict[str, Any]]:
    """The prompt tokens and create_completion keyword arguments of a /completion request body: its
    `prompt` text (BOS added where the vocabulary asks, special tokens parsed, as llama-server) or ids;
    `ignore_eos` as llama-server's."""
    kw = native_kwargs(body, ("prompt",))
    if body.get("ignore_eos"):
        kw["logit_bias"] = no_end_of_text(llm)
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return llm.tokenize(prompt.encode(), add_bos=True, special=True), kw
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt, kw
    raise BadRequest('"prompt" must be a string or a non-empty array of token ids')


def infill_request(llm: SpeculativeLlama, body: Any) -> tuple[list[int], dict[str, Any]]:
    """The prompt tokens and create_completion keyword arguments of an /infill request body (llama-server's
    fields: input_prefix, input_suffix, input_extra, prompt, n_predict, ...)."""
    kw = native_kwargs(body, ("input_prefix", "input_suffix"))
    extra = body.get("input_extra", [])
    if not isinstance(extra, list):
        raise BadRequest('"input_extra" must be an array of {"filename": string, "text": string}')
    # llama-server's prompt layout takes ITS -n, not the request's: a server started without one has -1
    return llm.infill_tokens(body["input_prefix"], body["input_suffix"], body.get("prompt", ""), extra), kw


# llama-server's native generation routes: how each makes its prompt
NATIVE = {"/completion": completion_request, "/completions": completion_request, "/infill": infill_request}
