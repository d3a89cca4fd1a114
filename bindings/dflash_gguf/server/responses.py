"""Responses in llama-server's and OpenAI's shapes: token routes, native completions, timings, errors."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from ..llama_compat import LogprobEntry
from ..speculative import GenerationStats, SpeculativeLlama
from .requests import BadRequest


def tokenize_response(llm: SpeculativeLlama, body: Any) -> dict[str, Any]:
    """llama-server's /tokenize: {"tokens": ids}, or with with_pieces [{"id", "piece"}] (a piece that is
    not UTF-8 as its byte values)."""
    if not isinstance(body, dict) or not isinstance(body.get("content", ""), str):
        raise BadRequest('"content" must be a string')
    tokens = llm.tokenize(
        body.get("content", "").encode(),
        add_bos=bool(body.get("add_special", False)),
        special=bool(body.get("parse_special", True)),
    )
    if not body.get("with_pieces", False):
        return {"tokens": tokens}
    out = []
    for t in tokens:
        piece = llm.detokenize([t], special=True)
        try:
            out.append({"id": t, "piece": piece.decode("utf-8")})
        except UnicodeDecodeError:
            out.append({"id": t, "piece": list(piece)})
    return {"tokens": out}


def detokenize_response(llm: SpeculativeLlama, body: Any) -> dict[str, Any]:
    """llama-server's /detokenize: the tokens' pieces (special tokens' text included) joined."""
    tokens = body.get("tokens", []) if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < llm.n_vocab() for t in tokens):
        raise BadRequest(f'"tokens" must be an array of token ids below {llm.n_vocab()}')
    return {"content": b"".join(llm.detokenize([t], special=True) for t in tokens).decode("utf-8", "replace")}


def native_response(
    text: str, model: str, last: tuple[str, SpeculativeLlama] | None, probs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """One /completion or /infill answer or stream chunk in llama-server's native shape; the last (`last`: the
    prompt as text and the model that generated it) with stop true, how it stopped and the figures; `probs`
    (n_probs) its tokens' completion_probabilities (native_probs)."""
    out: dict[str, Any] = {"content": text, "stop": last is not None, "model": model}
    if probs:
        out["completion_probabilities"] = probs
    if last is not None:
        prompt, llm = last
        s = llm.stats
        word = llm.stopping_word
        ended = "word" if word else "eos" if s.end_of_text else "limit" if llm.finish_reason == "length" else "none"
        out.update(
            prompt=prompt,
            tokens_predicted=s.generated_tokens,
            tokens_evaluated=s.prompt_tokens,
            tokens_cached=s.prompt_tokens + max(s.generated_tokens - 1, 0),  # what the context holds
            truncated=False,
            stop_type=ended,
            stopping_word=word,
            timings=timings(s),
        )
    return out


def native_probs(entries: list[LogprobEntry], piece: Callable[[int, bool], bytes]) -> list[dict[str, Any]]:
    """llama-server's completion_probabilities of generated tokens (n_probs): each token's id, text (its own
    piece, short of a character it leaves unfinished), bytes and log-probability under the raw logits, and
    the most likely tokens' the same way."""

    def token(tok: int, logprob: float) -> dict[str, Any]:
        p = piece(tok, False)
        return {"id": tok, "token": whole_characters(p), "bytes": list(p), "logprob": logprob}

    return [
        {**token(e.id, e.logprob), "top_logprobs": [token(i, v) for i, v in e.best]}
        for e in entries
        if e.logprob is not None
    ]


def whole_characters(piece: bytes) -> str:
    """`piece` as text without a character its last bytes begin and do not finish (llama-server's
    validate_utf8)."""
    for i in range(1, min(4, len(piece)) + 1):
        lead = piece[-i]
        needs = 2 if lead & 0xE0 == 0xC0 else 3 if lead & 0xF0 == 0xE0 else 4 if lead & 0xF8 == 0xF0 else 0
        if i < needs:
            piece = piece[:-i]
            break
    return piece.decode("utf-8", "replace")


# llama-server's ChatML, the template its /props shows for a model without one (chat.chatml renders it)
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\n' -}}\n"
    "{%- endif -%}"
)


def props_response(
    llm: SpeculativeLlama,
    model_name: str,
    slots: int,
    reasoning_format: str,
    metrics: bool,
    slots_route: bool,
    sampling: dict[str, Any],
) -> dict[str, Any]:
    """llama-server's GET /props, the fields that describe this server: a slot's context size and the native
    routes' sampling defaults (the server's `sampling`, else create_completion's, under llama-server's
    names), the slots, the model, its chat template and BOS / EOS text. Clients read n_ctx and the template
    from it."""
    from llama_cpp import __version__ as llama_cpp_version

    from .. import __version__

    defaults = {k: v.default for k, v in inspect.signature(llm.create_completion).parameters.items()}
    defaults.update(sampling)
    limit = sampling.get("max_tokens")  # the native routes' default: the server's -n, else no limit
    limit = -1 if limit is None else limit
    params = {
        # llama.cpp's LLAMA_DEFAULT_SEED: a random seed per request
        "seed": 4294967295 if defaults["seed"] is None else defaults["seed"],
        **{k: defaults[k] for k in ("temperature", "top_k", "top_p", "min_p", "typical_p")},
        "repeat_last_n": llm.last_n_tokens_size,
        **{k: defaults[k] for k in ("repeat_penalty", "presence_penalty", "frequency_penalty")},
        "mirostat": defaults["mirostat_mode"],
        **{k: defaults[k] for k in ("mirostat_tau", "mirostat_eta")},
        "max_tokens": limit,
        "n_predict": limit,
        "ignore_eos": False,
        "stream": False,
        "n_probs": 0,
        "reasoning_format": reasoning_format,
        "speculative.n_max": llm.n_max,
    }

    def piece(token: int) -> str:
        return llm.detokenize([token], special=True).decode("utf-8", "replace") if token >= 0 else ""

    return {
        "default_generation_settings": {"params": params, "n_ctx": llm.n_ctx()},
        "total_slots": slots,
        "model_alias": model_name,
        "model_path": llm.model_path,
        "modalities": {"vision": False, "video": False, "audio": False},
        "endpoint_slots": slots_route,
        "endpoint_props": False,
        "endpoint_metrics": metrics,
        "chat_template": llm.chat_template or CHATML_TEMPLATE,
        "bos_token": piece(llm.token_bos()),
        "eos_token": piece(llm.token_eos()),
        "build_info": f"dflash-gguf {__version__}, llama-cpp-python {llama_cpp_version}",
        "is_sleeping": False,
    }


def timings(s: GenerationStats) -> dict[str, Any]:
    """llama-server's `timings` of a response (its names), from the generation's statistics: cache_n prompt
    tokens came from the context already (or a saved state), prompt_n were decoded; draft_n tokens drafted,
    draft_n_accepted of them accepted."""
    return {
        "cache_n": s.reused_prompt_tokens,
        "prompt_n": s.prompt_tokens - s.reused_prompt_tokens,
        "prompt_ms": s.prefill_ms,
        "predicted_n": s.generated_tokens,
        "predicted_ms": s.decode_ms,
        "predicted_per_second": s.tokens_per_second,
        "draft_n": s.drafted,
        "draft_n_accepted": s.accepted,
        "mean_accepted_length": s.mean_accepted_length,
    }


def openai_last_events(held: dict[str, Any], s: GenerationStats, usage: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A stream's last chunk with the generation's timings, then (stream_options.include_usage) OpenAI's
    usage chunk with `usage`."""
    events = [{**held, "timings": timings(s)}]
    if usage is not None:
        events.append(
            {
                **{k: held[k] for k in ("id", "object", "created", "model", "system_fingerprint")},
                "choices": [],
                "usage": usage,
            }
        )
    return events


_ERROR_TYPES = {HTTPStatus.NOT_IMPLEMENTED: "not_supported_error", HTTPStatus.SERVICE_UNAVAILABLE: "unavailable_error"}


def error_body(status: HTTPStatus, message: str) -> dict[str, Any]:
    # llama-server's types for its 501 and 503, OpenAI's otherwise
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
