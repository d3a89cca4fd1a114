"""Fill-in-the-middle prompts: the code before and after a cursor, in the target's FIM tokens.

Two layouts, both prefix-suffix-middle (PSM, what code models' cards give and llama-server uses
unless started with --spm-infill):
- `fim_prompt`: [BOS] <FIM_PRE> prefix <FIM_SUF> suffix <FIM_MID>, for create_completion's `suffix`.
- `server_infill_prompt`: llama-server's /infill (its format_prompt_infill), so that editor plugins
  written for it (llama.vim, llama.vscode) get the same prompt: the repository-level context of
  `input_extra` chunks first (<FIM_REP>myproject, then <FIM_SEP>filename and text per chunk, where the
  vocabulary has those tokens), the prefix cut to 3/4 of a batch, the suffix to what is left of 1/4.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# llama-server's separator of extra chunks for vocabularies without <FIM_SEP> ("\n\n--- snippet ---\n\n")
_SNIPPET = "\n\n--- snippet ---\n\n"

Tokenize = Callable[[str, bool], list[int]]  # (text, parse special tokens) -> tokens, no BOS


def require_fim(fim: dict[str, int], target: str) -> None:
    """ValueError naming the missing tokens unless the vocabulary has <FIM_PRE>, <FIM_SUF>, <FIM_MID>."""
    missing = [k for k in ("pre", "suf", "mid") if fim.get(k, -1) < 0]
    if missing:
        keys = ", ".join(f"tokenizer.ggml.fim_{k}_token_id" for k in missing)
        raise ValueError(
            f"fill-in-the-middle (a suffix) needs a target whose vocabulary has FIM tokens; {target} has no {keys}"
        )


def fim_prompt(fim: dict[str, int], bos: list[int], prefix: Sequence[int], suffix: Sequence[int]) -> list[int]:
    """[BOS] <FIM_PRE> prefix <FIM_SUF> suffix <FIM_MID> (`bos`: [] or [the BOS the vocabulary asks for])."""
    return [*bos, fim["pre"], *prefix, fim["suf"], *suffix, fim["mid"]]


def server_infill_prompt(
    fim: dict[str, int],
    bos: list[int],
    tokenize: Tokenize,
    input_prefix: str,
    input_suffix: str,
    prompt: str = "",
    input_extra: Sequence[dict[str, Any]] = (),
    n_batch: int = 2048,
    n_ctx: int = 4096,
    n_predict: int = -1,
) -> list[int]:
    """llama-server's /infill prompt; n_batch, n_ctx and n_predict are the server's settings (which
    bound how much prefix, suffix and extra context it keeps)."""

    def text(s: str) -> list[int]:
        return tokenize(s, False)

    extra: list[int] = []
    if fim.get("rep", -1) >= 0:
        extra += [fim["rep"], *text("myproject\n")]
    for chunk in input_extra:
        if fim.get("sep", -1) >= 0:
            extra += [fim["sep"], *text(chunk.get("filename", "tmp") + "\n")]
        else:
            extra += text(_SNIPPET)
        extra += text(chunk["text"])
    if fim.get("sep", -1) >= 0:
        extra += [fim["sep"], *text("filename\n")]
    prefix, suffix, middle = text(input_prefix), text(input_suffix), tokenize(prompt, True)
    n_prefix = min(len(prefix), 3 * (n_batch // 4))
    n_suffix = min(len(suffix), max(0, n_batch // 4 - (2 + len(middle))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra))
    body = fim_prompt(fim, bos, prefix[len(prefix) - n_prefix :] + middle, suffix[:n_suffix])
    return extra[len(extra) - n_extra :] + body
