"""The `dflash` command line: info, generate, chat, serve, bench and draft-vocab."""

from __future__ import annotations

import inspect
import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from . import DFlashError, inspect_draft
from .info import format_text, summarize

if TYPE_CHECKING:
    from .speculative import SpeculativeLlama


def _fail(e: Exception) -> NoReturn:
    click.echo(f"dflash: error: {e}", err=True)
    sys.exit(2)


def _read_text(path: str, what: str) -> str:
    """A file's text byte for byte (no newline translation), or a one-line error naming the file."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        _fail(ValueError(f"{path}: cannot read {what} as UTF-8 text: {e}"))


@click.group()
@click.version_option(package_name="dflash-gguf")
def main() -> None:
    """DFlash / DFlash2 speculative decoding for llama.cpp models."""


@main.command()
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def info(path: str, as_json: bool) -> None:
    """Validate a drafter GGUF with the C++ loader and describe it."""
    try:
        s = summarize(inspect_draft(path))
    except DFlashError as e:
        _fail(e)
    click.echo(json.dumps(s, indent=2) if as_json else format_text(s))


# where the target's weights go, as llama-server's flags (dflash generate / serve / bench)
_PLACEMENT_OPTIONS = [
    click.option(
        "--override-tensor",
        "-ot",
        multiple=True,
        metavar="PATTERN=TYPE[,...]",
        help="Target weights whose names match the regex PATTERN go to the ggml buffer type TYPE (CPU, "
        "CUDA0, ...), as llama-server's --override-tensor; repeatable, first match first.",
    ),
    click.option(
        "--cpu-moe",
        "-cmoe",
        is_flag=True,
        help="Keep every layer's MoE experts on the CPU (the rest offloaded with -ngl), as llama-server's.",
    ),
    click.option(
        "--n-cpu-moe",
        "-ncmoe",
        default=0,
        show_default=True,
        help="Keep the MoE experts of the first N layers on the CPU, as llama-server's.",
    ),
]

_DRAFT_VOCAB_OPTION = click.option(
    "--draft-vocab",
    type=click.Path(dir_okay=False),
    help="Drafts propose only this file's tokens (`dflash draft-vocab`: the target's most frequent on a corpus); "
    "the drafter's LM head then costs that share of the vocabulary. The output is unchanged.",
)

# for the commands that chat (chat, serve)
_CHAT_TEMPLATE_OPTION = click.option(
    "--chat-template-file",
    type=click.Path(dir_okay=False),
    help="Chat in this Jinja template instead of the target GGUF's (llama-server's --chat-template-file).",
)

_KV_CACHE_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
# the options that open a target + drafter pair (generate, chat, serve)
_MODEL_OPTIONS = [
    click.option("--target", "-m", required=True, type=click.Path(dir_okay=False), help="Target model GGUF."),
    click.option(
        "--draft",
        "-d",
        "-md",
        "--spec-draft-model",
        "draft",
        required=True,
        type=click.Path(dir_okay=False),
        help="DFlash drafter GGUF (also llama-server's -md / --spec-draft-model).",
    ),
    click.option(
        "--n-max",
        "--spec-draft-n-max",
        "n_max",
        default="auto",
        show_default=True,
        help='Drafted tokens verified per step: "auto" (chosen per step from measured costs) or an int '
        "(0 = block size - 1); also llama-server's --spec-draft-n-max.",
    ),
    click.option(
        "--draft-q",
        type=click.Choice(["logits", "selector"]),
        default="logits",
        show_default=True,
        help="Which exact q the draft tokens are sampled from at temperature > 0.",
    ),
    click.option(
        "--sampler",
        type=click.Choice(["gumbel", "rejection"]),
        default="gumbel",
        show_default=True,
        help="At temperature > 0: gumbel = every draw keyed by (seed, position), so a seed fixes the text "
        "whatever the draft lengths; rejection = exact rejection sampling with q (a few percent more "
        "accepted, the text depends on the drafts).",
    ),
    click.option("--ctx-size", "-c", default=4096, show_default=True, help="Context size."),
    click.option(
        "--batch-size",
        "-b",
        default=512,
        show_default=True,
        help="Prompt tokens per decode; also where /infill cuts the prefix and suffix, as llama-server "
        "(whose default is 2048).",
    ),
    click.option("--n-gpu-layers", "-ngl", default=0, show_default=True, help="Target layers on the GPU."),
    click.option(
        "--threads",
        "-t",
        default=0,
        show_default=True,
        help="CPU threads (0 = the physical cores this process may run on).",
    ),
    click.option(
        "--device",
        "-devd",
        "--spec-draft-device",
        "device",
        default="auto",
        show_default=True,
        help="ggml device for the drafter: auto (where the target's layers are), cpu, CUDA0, ... (also "
        "llama-server's -devd / --spec-draft-device).",
    ),
    click.option(
        "--no-repack",
        is_flag=True,
        help="Keep the target's weights out of libllama's repacked / AMX CPU buffers (llama-server's "
        "--no-repack) and the drafter's in their file layout. Default: all of them, except where AMX "
        "would take the target's (an AMX CPU and weights of a type its kernels take), where libllama can "
        "crash: there its layers' weights go to ggml's repacked layouts by name; a quantized drafter's "
        "in ggml's repacked CPU layouts (never AMX).",
    ),
    click.option(
        "--swa-full",
        is_flag=True,
        help="Sliding-window layers keep every position, the target's and the drafter's (llama-server's "
        "--swa-full). Default: a window and a batch of positions (a rollback past them restores a prompt's "
        "checkpoint and re-decodes the tokens after it).",
    ),
    *_PLACEMENT_OPTIONS,
    _DRAFT_VOCAB_OPTION,
    click.option(
        "--cache-type-k",
        "-ctk",
        "cache_type_k",
        type=click.Choice(_KV_CACHE_TYPES),
        default="f16",
        show_default=True,
        help="The target's K cache type (llama-server's; q8_0: 8.5 bits a value against f16's 16).",
    ),
    click.option(
        "--cache-type-v",
        "-ctv",
        "cache_type_v",
        type=click.Choice(_KV_CACHE_TYPES),
        default="f16",
        show_default=True,
        help="The target's V cache type (a quantized one turns flash attention on, as llama-server does).",
    ),
    click.option(
        "--lora",
        multiple=True,
        help="A LoRA adapter GGUF on the target's weights at scale 1 (llama-server's; repeatable, or comma-separated).",
    ),
    click.option(
        "--lora-scaled",
        multiple=True,
        help="FNAME:SCALE: a LoRA adapter at that scale (llama-server's; repeatable, or comma-separated).",
    ),
    click.option("--verbose", is_flag=True, help="Show libllama's log."),
]


def _template_kwargs(kwargs: dict[str, Any], reasoning: str, effort: str | None) -> dict[str, Any]:
    """Chat template arguments with -rea / --reasoning-effort's over them (llama-server's: "default" effort
    leaves the template's own)."""
    if reasoning != "auto":
        kwargs = {**kwargs, "enable_thinking": reasoning == "on"}
    if effort is not None and effort != "default":
        kwargs = {**kwargs, "reasoning_effort": effort}
    return kwargs


def _lora_adapters(lora: tuple[str, ...], lora_scaled: tuple[str, ...]) -> list[tuple[str, float]]:
    """--lora's and --lora-scaled's adapters, (file, scale) each, in llama-server's order (--lora first)."""
    out = [(f, 1.0) for item in lora for f in item.split(",") if f]
    for item in (f for items in lora_scaled for f in items.split(",") if f):
        file, _, scale = item.rpartition(":")
        try:
            out.append((file, float(scale)))
        except ValueError:
            raise click.BadParameter(f"expected FNAME:SCALE, got {item!r}", param_hint="--lora-scaled") from None
        if not file:
            raise click.BadParameter(f"expected FNAME:SCALE, got {item!r}", param_hint="--lora-scaled")
    return out


def _options(options: list[Callable[..., Any]]) -> Callable[..., Any]:
    def apply(f: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            f = option(f)
        return f

    return apply


_model_options = _options(_MODEL_OPTIONS)
# chat's and serve's (llama-server's and llama-cli's)
_reasoning_options = _options(
    [
        click.option(
            "-rea",
            "--reasoning",
            type=click.Choice(["on", "off", "auto"]),
            default="auto",
            show_default=True,
            help="Think or not, where the chat template lets one choose (enable_thinking; auto: the template's "
            "default).",
        ),
        click.option(
            "--reasoning-effort",
            help="The reasoning effort the chat template gets (reasoning_effort: low, medium, high, ...; gpt-oss's).",
        ),
        click.option(
            "--reasoning-budget",
            type=click.IntRange(min=-1),
            default=-1,
            show_default=True,
            help="Tokens a reply may think before the end of its thinking is written for it (0 = no thinking, "
            "-1 = no limit).",
        ),
        click.option("--reasoning-budget-message", help="Written before that end of the thinking."),
    ]
)


def _model_from_options(options: dict[str, Any]) -> SpeculativeLlama:
    """The model the _MODEL_OPTIONS among a command's `options` describe (with the _SAMPLING_OPTIONS'
    penalty window)."""
    names = set(inspect.signature(_open_model).parameters) - {"kw"}
    return _open_model(**{k: v for k, v in options.items() if k in names}, last_n_tokens_size=options["repeat_last_n"])


# the sampling options (generate, chat; serve: as defaults for requests), with the create_* argument each sets
_SAMPLING_SPECS: list[tuple[tuple[str, ...], dict[str, Any], str]] = [
    (("--temp",), dict(default=0.0, help="Temperature (0 = greedy, lossless)."), "temperature"),
    (("--top-k",), dict(default=0, help="Top-k (0 = off)."), "top_k"),
    (("--top-p",), dict(default=1.0, help="Top-p (1 = off)."), "top_p"),
    (("--min-p",), dict(default=0.0, help="Min-p (0 = off)."), "min_p"),
    (("--typical", "typical_p"), dict(default=1.0, help="Locally typical sampling, p (1 = off)."), "typical_p"),
    (
        ("--mirostat", "mirostat_mode"),
        dict(
            type=click.IntRange(0, 2),
            default=0,
            help="Mirostat sampling (1 = v1, 2 = v2; 0 = off), instead of top-k .. min-p.",
        ),
        "mirostat_mode",
    ),
    (("--mirostat-lr", "mirostat_eta"), dict(default=0.1, help="Mirostat learning rate, eta."), "mirostat_eta"),
    (("--mirostat-ent", "mirostat_tau"), dict(default=5.0, help="Mirostat target entropy, tau."), "mirostat_tau"),
    (
        ("--repeat-penalty",),
        dict(
            default=1.0,
            help="Penalize tokens among the last --repeat-last-n generated (1 = off; applies when greedy too).",
        ),
        "repeat_penalty",
    ),
    (("--presence-penalty",), dict(default=0.0, help="Presence penalty (0 = off)."), "presence_penalty"),
    (("--frequency-penalty",), dict(default=0.0, help="Frequency penalty (0 = off)."), "frequency_penalty"),
    (("--seed",), dict(default=-1, help="RNG seed (-1 = random)."), "seed"),
]
# the option's parameter name -> the create_* argument
_SAMPLING_ARGS = {(a[1] if len(a) > 1 else a[0][2:].replace("-", "_")): arg for a, _, arg in _SAMPLING_SPECS}
_SAMPLING_OPTIONS = [
    *(click.option(*a, **{"type": type(k["default"]), "show_default": True, **k}) for a, k, _ in _SAMPLING_SPECS),
    click.option("--repeat-last-n", default=64, show_default=True, help="Generated tokens the penalties look at."),
]
_sampling_options = _options(_SAMPLING_OPTIONS)
# serve's: defaults for the requests that give none (the create_* defaults where not given)
_server_sampling_options = _options(
    [
        click.option(
            *a, **{"type": type(k["default"]), **k, "default": None, "help": k["help"] + " Requests' default."}
        )
        for a, k, _ in _SAMPLING_SPECS
    ]
)


def _sampling(**options: Any) -> dict[str, Any]:
    """The create_completion / create_chat_completion arguments of the sampling options given (not None)."""
    kw = {_SAMPLING_ARGS[k]: v for k, v in options.items() if k in _SAMPLING_ARGS and v is not None}
    if kw.get("seed", 0) < 0:
        kw["seed"] = None
    return kw


def _open_model(
    target: str,
    draft: str,
    n_max: str,
    draft_q: str,
    sampler: str,
    ctx_size: int,
    batch_size: int,
    n_gpu_layers: int,
    threads: int,
    device: str,
    no_repack: bool,
    verbose: bool,
    override_tensor: tuple[str, ...] = (),
    cpu_moe: bool = False,
    n_cpu_moe: int = 0,
    draft_vocab: str | None = None,
    swa_full: bool = False,
    chat_template_file: str | None = None,
    lora: tuple[str, ...] = (),
    lora_scaled: tuple[str, ...] = (),
    cache_type_k: str = "f16",
    cache_type_v: str = "f16",
    **kw: Any,
) -> SpeculativeLlama:
    from .speculative import SpeculativeLlama

    if chat_template_file is not None:
        kw["chat_template"] = _read_text(chat_template_file, "the chat template")

    return SpeculativeLlama(
        target,
        draft,
        n_ctx=ctx_size,
        n_batch=batch_size,
        n_gpu_layers=n_gpu_layers,
        n_threads=threads,
        n_max=int(n_max) if n_max.isdigit() else n_max,
        draft_q=draft_q,
        sampler=sampler,
        device=device,
        repack=False if no_repack else None,
        swa_full=swa_full,
        override_tensor=list(override_tensor),
        cpu_moe=cpu_moe,
        n_cpu_moe=n_cpu_moe,
        draft_vocab=draft_vocab,
        verbose=verbose,
        lora_adapters=_lora_adapters(lora, lora_scaled),
        type_k=cache_type_k,
        type_v=cache_type_v,
        **kw,
    )


@main.command()
@_model_options
@click.option("--prompt", "-p", help="Prompt text (raw, no chat template).")
@click.option(
    "--file",
    "-f",
    "prompt_file",
    type=click.Path(exists=True, dir_okay=False),
    help="Read the prompt from this UTF-8 file, byte for byte (a shell's $(...) drops trailing newlines).",
)
@click.option("-n", "--n-predict", default=128, show_default=True, help="Tokens to generate.")
@_sampling_options
@click.option("--grammar", help="GBNF grammar the output must follow (llama.cpp's --grammar).")
@click.option("--grammar-file", type=click.Path(dir_okay=False), help="Read the GBNF grammar from this file.")
@click.option(
    "--json-schema", "-j", help="A JSON schema the output must follow (llama.cpp's --json-schema; {} = any JSON value)."
)
@click.option("--json-schema-file", type=click.Path(dir_okay=False), help="Read the JSON schema from this file.")
@click.option("--no-stream", is_flag=True, help="Print the text at the end instead of streaming it.")
def generate(
    prompt: str | None,
    prompt_file: str | None,
    n_predict: int,
    grammar: str | None,
    grammar_file: str | None,
    json_schema: str | None,
    json_schema_file: str | None,
    no_stream: bool,
    **options: Any,
) -> None:
    """Generate text with speculative decoding, then print the statistics."""
    if (prompt is None) == (prompt_file is None):
        _fail(ValueError("give the prompt with exactly one of --prompt / -p and --file / -f"))
    if prompt_file is not None:
        prompt = _read_text(prompt_file, "the prompt")
    assert prompt is not None  # for the type checker: one of the two was given
    constraints = [
        name
        for name, v in (
            ("--grammar", grammar),
            ("--grammar-file", grammar_file),
            ("--json-schema", json_schema),
            ("--json-schema-file", json_schema_file),
        )
        if v is not None
    ]
    if len(constraints) > 1:
        _fail(ValueError(f"give at most one of {', '.join(constraints)}"))
    if grammar_file is not None:
        grammar = _read_text(grammar_file, "the grammar")
    if json_schema_file is not None:
        json_schema = _read_text(json_schema_file, "the JSON schema")
    if json_schema is not None:
        from .llama_compat import schema_grammar

        where = json_schema_file or "--json-schema"
        try:
            grammar = schema_grammar(json.loads(json_schema), where)
        except json.JSONDecodeError as e:
            _fail(ValueError(f"{where}: not JSON: {e}"))
        except ValueError as e:
            _fail(e)

    try:
        llm = _model_from_options(options)
        kw = dict(max_tokens=n_predict, grammar=grammar, **_sampling(**options))
        if no_stream:
            click.echo(prompt + llm.create_completion(prompt, **kw)["choices"][0]["text"])
        else:
            chunks = llm.create_completion(prompt, stream=True, **kw)  # bad settings raise here, before any text
            first = next(chunks, None)  # the prefill: a grammar that does not parse raises here, before any text
            click.echo(prompt, nl=False)
            for chunk in itertools.chain([first] if first else [], chunks):
                click.echo(chunk["choices"][0]["text"], nl=False)
            click.echo()
    except (ValueError, RuntimeError) as e:
        _fail(e)
    click.echo(f"[dflash] {llm.stats.line()}", err=True)


@main.command()
@_model_options
@_sampling_options
@_CHAT_TEMPLATE_OPTION
@click.option("--system-prompt", "-sys", help="The conversation's system message.")
@click.option("--prompt", "-p", help="The first message; the conversation goes on from the standard input.")
@click.option(
    "--single-turn", "-st", is_flag=True, help="Answer one message (--prompt, else the first read), then exit."
)
@click.option(
    "-n", "--n-predict", default=-1, show_default=True, help="Tokens per reply at most (-1 = to the end of the turn)."
)
@click.option(
    "--reasoning-format",
    type=click.Choice(["deepseek", "none"]),
    default="deepseek",
    show_default=True,
    help="deepseek: a reasoning model's thinking shown dimmed, kept out of the conversation; none: as text.",
)
@click.option("--no-thinking", is_flag=True, help="Ask the template not to think (the same as -rea off).")
@_reasoning_options
def chat(
    system_prompt: str | None,
    prompt: str | None,
    single_turn: bool,
    n_predict: int,
    reasoning_format: str,
    no_thinking: bool,
    reasoning: str,
    reasoning_effort: str | None,
    reasoning_budget: int,
    reasoning_budget_message: str | None,
    **options: Any,
) -> None:
    """Chat with the target in its chat template (llama-cli's conversation mode): a message per line read
    (a line ending in \\ goes on), the replies streamed, the statistics after each."""
    from .chat_cli import converse

    try:
        llm = _model_from_options(options)
    except (ValueError, RuntimeError) as e:
        _fail(e)
    reply_options = dict(
        max_tokens=None if n_predict < 0 else n_predict,
        reasoning_format=reasoning_format,
        chat_template_kwargs=_template_kwargs({}, "off" if no_thinking else reasoning, reasoning_effort) or None,
        reasoning_budget_tokens=reasoning_budget,
        reasoning_budget_message=reasoning_budget_message,
        **_sampling(**options),
    )
    converse(llm, prompt, system_prompt, single_turn, reply_options)


@main.command()
@_model_options
@_CHAT_TEMPLATE_OPTION
@_server_sampling_options
@click.option(
    "-n", "--n-predict", type=int, help="Tokens per answer at most, requests' default (-1 = to the end of the text)."
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", default=8080, show_default=True, help="Port (0 = any free one; the address is printed).")
@click.option("--alias", help="Model name in responses and /v1/models [default: the target file's name].")
@click.option(
    "--api-key",
    envvar="DFLASH_API_KEY",
    help="Require `Authorization: Bearer KEY` (or `X-Api-Key: KEY`) on every route but /health (or set "
    "DFLASH_API_KEY).",
)
@click.option(
    "--cache-ram",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="MiB of saved contexts kept in RAM (llama_cpp.LlamaRAMCache): a conversation that comes back "
    "is not prefilled again. 0 = off.",
)
@click.option(
    "--reasoning-format",
    type=click.Choice(["none", "auto", "deepseek"]),
    default="deepseek",
    show_default=True,
    help="Chats' default, as llama-server's: deepseek/auto = a reasoning model's "
    "<think> text in message.reasoning_content; none = left in the content.",
)
@click.option(
    "--chat-template-kwargs",
    help="A JSON object every chat's template gets, under a request's own (llama-server's; e.g. "
    "'{\"enable_thinking\": false}').",
)
@_reasoning_options
@click.option(
    "-np",
    "--parallel",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Generations served at once, each in a slot with its own context on the one loaded model "
    "(llama-server's --parallel); more requests wait for a free slot. Each slot uses --threads threads.",
)
@click.option(
    "--metrics",
    is_flag=True,
    help="Serve GET /metrics: tokens, timings and speculative acceptance (per draft position too) since the "
    "start, in Prometheus' text format under llama-server's names.",
)
@click.option(
    "--slot-save-path",
    type=click.Path(file_okay=False, exists=True),
    help="Serve POST /slots/{id}?action=save|restore|erase: slot contexts saved to and restored from files of "
    "this directory (llama-server's).",
)
@click.option(
    "--lora-init-without-apply",
    is_flag=True,
    help="Load the LoRA adapters at scale 0 until POST /lora-adapters or a request's `lora` sets one (llama-server's).",
)
@click.option(
    "--slots/--no-slots",
    default=True,
    show_default=True,
    help="Serve GET /slots: each slot's context size, whether it is generating, its latest prompt's counts "
    "(llama-server's; `?fail_on_no_slot=1` answers 503 while every slot is busy).",
)
def serve(
    host: str,
    port: int,
    alias: str | None,
    api_key: str | None,
    cache_ram: int,
    reasoning_format: str,
    chat_template_kwargs: str | None,
    reasoning: str,
    reasoning_effort: str | None,
    reasoning_budget: int,
    reasoning_budget_message: str | None,
    parallel: int,
    metrics: bool,
    slots: bool,
    n_predict: int | None,
    lora_init_without_apply: bool,
    slot_save_path: str | None,
    **model: Any,
) -> None:
    """An OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/responses (streaming too),
    /v1/models; Anthropic's /v1/messages; llama-server's native routes."""
    from .server import make_server

    defaults = _sampling(**model)  # the sampling options given: every request's unless it names its own
    if n_predict is not None:
        defaults["max_tokens"] = None if n_predict < 0 else n_predict
    model = {k: v for k, v in model.items() if k not in _SAMPLING_ARGS}
    template_kwargs = None
    if chat_template_kwargs is not None:
        try:
            template_kwargs = json.loads(chat_template_kwargs)
        except json.JSONDecodeError as e:
            _fail(ValueError(f"--chat-template-kwargs: not JSON: {e}"))
        if not isinstance(template_kwargs, dict):
            _fail(ValueError(f"--chat-template-kwargs must be a JSON object, got {chat_template_kwargs}"))
    template_kwargs = _template_kwargs(template_kwargs or {}, reasoning, reasoning_effort) or None
    try:
        llm = _open_model(**model)
        if cache_ram:
            from llama_cpp import LlamaRAMCache

            llm.set_cache(LlamaRAMCache(capacity_bytes=cache_ram << 20))
        name = alias or Path(model["target"]).stem
        server = make_server(
            llm,
            host,
            port,
            name,
            api_key,
            reasoning_format,
            parallel,
            metrics,
            slots,
            template_kwargs,
            defaults,
            reasoning_budget,
            reasoning_budget_message,
            lora_init_without_apply,
            slot_save_path,
        )
    except (ValueError, RuntimeError, OSError) as e:
        _fail(e)
    h, p = server.server_address[:2]
    vocab = f"drafts from {llm.draft_vocab_size} of {llm.n_vocab()} tokens; " if model.get("draft_vocab") else ""
    click.echo(
        f"[dflash] serving {Path(model['target']).name} + {Path(model['draft']).name} on http://{h}:{p}/v1 "
        f"({parallel} slot{'s' if parallel > 1 else ''}; {vocab}Ctrl-C stops)",
        err=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        llm.close()


@main.command()
@click.option("--target", "-m", type=click.Path(dir_okay=False), help="Target model GGUF (not with --scale).")
@click.option("--draft", "-d", type=click.Path(dir_okay=False), help="DFlash drafter GGUF (not with --scale).")
@click.option(
    "--prompts",
    type=click.Path(dir_okay=False),
    help='JSONL, one {"id": ..., "text": ...} per line (raw text, no chat template; not with --scale).',
)
@click.option(
    "--scale",
    is_flag=True,
    help="Instead: ar / ours / upstream end to end on the bundled pair inflated to Qwen3-0.6B ... 8B "
    "shapes (generated and cached; docs/performance.md).",
)
@click.option(
    "--scale-sizes",
    default="0.6B,1.7B",
    show_default=True,
    help="--scale: comma list of 0.6B, 1.7B, 4B, 8B (Qwen3 shapes), 2.8B-hybrid (a Qwen3.5 hybrid), 4.5B-moe "
    "(a Qwen3 MoE) and 7B-hybrid-moe (a Qwen3.5 MoE hybrid).",
)
@click.option(
    "--scale-types",
    default="f16,q8_0,q4_k_m",
    show_default=True,
    help="--scale: target types (any dflash-convert --outtype libllama quantizes to, e.g. bf16, q5_k_m).",
)
@click.option(
    "--scale-dir",
    type=click.Path(file_okay=False),
    help="--scale: where the generated GGUFs are kept and reused [default: ~/.cache/dflash-gguf/scale].",
)
@click.option(
    "-n", "--n-predict", type=int, default=None, help="Tokens to generate per prompt [default: 128; --scale: 32]."
)
@click.option("--temp", default=0.0, show_default=True, help="Temperature (0 = greedy).")
@click.option("--top-k", default=0, show_default=True, help="Top-k for every system (0 = off).")
@click.option("--top-p", default=1.0, show_default=True, help="Top-p for every system (1 = off).")
@click.option("--min-p", default=0.0, show_default=True, help="Min-p for every system (0 = off).")
@click.option(
    "--n-max",
    default=None,
    help="Drafted tokens per step: an int (0 = block size - 1), a comma list (one configuration "
    "each, all run side by side on the same prompt runs), or 'auto' [default: 0; --scale: 2,3,auto].",
)
@click.option("--repeat", default=1, show_default=True, help="Rounds over the prompts.")
@click.option(
    "--systems",
    default="ar,ours,upstream",
    show_default=True,
    help="Comma list of ar, ours, upstream, upstream-ar (ar always runs: it is the baseline).",
)
@click.option(
    "--limit", type=int, default=None, help="Use only the first N prompts (0 = all) [default: all; --scale: 3]."
)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write all raw per-prompt figures here.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), help="Write a PNG (acceptance, tok/s) here.")
@click.option(
    "--threads",
    "-t",
    default=0,
    show_default=True,
    help="CPU threads for every system (0 = the physical cores this process may run on).",
)
@click.option("--seed", default=0, show_default=True, help="Base RNG seed (per prompt: seed + index + 1000*round).")
@click.option("--ctx-size", "-c", default=2048, show_default=True, help="Context size for every system.")
@click.option("--n-gpu-layers", "-ngl", default=0, show_default=True, help="Target layers on the GPU.")
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="ggml device for our drafter (auto: where the target's layers are).",
)
@click.option(
    "--draft-q",
    type=click.Choice(["logits", "selector"]),
    default="logits",
    show_default=True,
    help="Which exact q our draft tokens are sampled from at temperature > 0.",
)
@click.option(
    "--server-binary",
    type=click.Path(dir_okay=False),
    help="llama-server to use (default: $DFLASH_LLAMA_SERVER, the build script's cache, PATH).",
)
@click.option("--server-arg", "server_args", multiple=True, help="Extra llama-server argument (repeatable).")
@_options(_PLACEMENT_OPTIONS)
@click.option(
    "--swa-full",
    is_flag=True,
    help="Sliding-window layers keep every position, for ours and llama-server alike (its --swa-full); "
    "default: a window, as llama-server's default (not with --scale, whose targets have none).",
)
@click.option(
    "--draft-vocab",
    help="Ours' drafting vocabularies: a comma list of `dflash draft-vocab` files, none = the whole vocabulary "
    "(e.g. none,V.json); each runs at every --n-max, side by side (not with --scale).",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def bench(
    target: str | None,
    draft: str | None,
    prompts: str | None,
    scale: bool,
    scale_sizes: str,
    scale_types: str,
    scale_dir: str | None,
    n_predict: int | None,
    temp: float,
    top_k: int,
    top_p: float,
    min_p: float,
    n_max: str | None,
    repeat: int,
    systems: str,
    limit: int | None,
    json_out: str | None,
    plot_out: str | None,
    threads: int,
    seed: int,
    ctx_size: int,
    n_gpu_layers: int,
    device: str,
    draft_q: str,
    server_binary: str | None,
    server_args: tuple[str, ...],
    override_tensor: tuple[str, ...],
    cpu_moe: bool,
    n_cpu_moe: int,
    swa_full: bool,
    draft_vocab: str | None,
    no_progress: bool,
) -> None:
    """Plain decoding (ar) vs our speculative loop (ours) vs llama-server (upstream), interleaved.

    With --scale: the same, end to end, on the bundled pair inflated to realistic sizes (no --target/--draft/
    --prompts)."""
    from .bench import BenchError, BenchOptions, format_table, parse_n_max, parse_systems, run_bench, write_json
    from .bench.options import parse_draft_vocab

    if scale:
        given = [
            name
            for name, v in (
                ("--target", target),
                ("--draft", draft),
                ("--prompts", prompts),
                ("--plot", plot_out),
                ("--draft-vocab", draft_vocab),
                ("--swa-full", swa_full),
            )
            if v
        ]
        # greedy with the bench's own settings, so that every output can be checked against ar's
        source = click.get_current_context().get_parameter_source
        given += [
            "--" + name.replace("_", "-")
            for name in ("temp", "top_k", "top_p", "min_p", "seed", "ctx_size", "draft_q")
            if source(name) is not click.core.ParameterSource.DEFAULT
        ]
        if given:
            raise click.UsageError(
                f"--scale generates its own models and prompts and decodes greedily; drop {', '.join(given)}"
            )
        _bench_scale(
            scale_sizes,
            scale_types,
            scale_dir,
            n_predict,
            n_max,
            limit,
            repeat,
            systems,
            threads,
            n_gpu_layers,
            device,
            {"override_tensor": list(override_tensor), "cpu_moe": cpu_moe, "n_cpu_moe": n_cpu_moe},
            {"server_binary": server_binary, "server_args": list(server_args)},
            json_out,
            not no_progress,
        )
        return
    missing = [name for name, v in (("--target", target), ("--draft", draft), ("--prompts", prompts)) if not v]
    if missing:
        raise click.UsageError(f"missing {', '.join(missing)} (required unless --scale)")
    assert target and draft and prompts
    try:
        opts = BenchOptions(
            target=target,
            draft=draft,
            prompts=prompts,
            n_predict=128 if n_predict is None else n_predict,
            temperature=temp,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            n_max=parse_n_max(n_max or "0"),
            repeat=repeat,
            systems=parse_systems(systems),
            threads=threads,
            seed=seed,
            n_ctx=ctx_size,
            n_gpu_layers=n_gpu_layers,
            device=device,
            draft_q=draft_q,
            limit=limit or None,
            server_binary=server_binary,
            server_args=list(server_args),
            override_tensor=list(override_tensor),
            cpu_moe=cpu_moe,
            n_cpu_moe=n_cpu_moe,
            swa_full=swa_full,
            draft_vocab=parse_draft_vocab(draft_vocab),
            progress=not no_progress,
        )
        result = run_bench(opts)
    except (BenchError, DFlashError, ValueError, RuntimeError) as e:
        _fail(e)
    click.echo(format_table(result))
    if json_out:
        write_json(result, json_out)
        click.echo(f"wrote {json_out}", err=True)
    if plot_out:
        from .bench.plot import plot

        plot(result, plot_out)
        click.echo(f"wrote {plot_out}", err=True)


def _bench_scale(
    sizes: str,
    types: str,
    folder: str | None,
    n_predict: int | None,
    n_max: str | None,
    limit: int | None,
    repeat: int,
    systems: str,
    threads: int,
    n_gpu_layers: int,
    device: str,
    placement: dict[str, Any],
    server: dict[str, Any],
    json_out: str | None,
    progress: bool,
) -> None:
    from pathlib import Path

    from dflash_convert.errors import ConversionError

    from .bench import BenchError, parse_systems
    from .bench import scale as bs

    try:
        result = bs.run_scale(
            bs.parse_sizes(sizes),
            folder=Path(folder) if folder else None,
            target_types=bs.parse_types(types),
            n_max=n_max or bs.DEFAULT_N_MAX,
            n_predict=bs.DEFAULT_N_PREDICT if n_predict is None else n_predict,
            limit=bs.DEFAULT_LIMIT if limit is None else (limit or None),
            repeat=repeat,
            systems=parse_systems(systems),
            threads=threads,
            n_gpu_layers=n_gpu_layers,
            device=device,
            placement=placement,
            server=server,
            progress=progress,
            # each target type's rows as soon as they are measured: a later one may fail, or be killed
            on_progress=(lambda partial: bs.write_json(partial, json_out)) if json_out else lambda partial: None,
        )
    except (BenchError, ConversionError, DFlashError, OSError, ValueError, RuntimeError) as e:
        _fail(e)
    click.echo(bs.format_table(result))
    if json_out:
        bs.write_json(result, json_out)
        click.echo(f"wrote {json_out}", err=True)


@main.command("draft-vocab")
@click.option("--target", "-m", required=True, type=click.Path(dir_okay=False), help="Target model GGUF.")
@click.option(
    "--size",
    default=32768,
    show_default=True,
    help="Tokens a draft may propose (at most the vocabulary's).",
)
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False), help="JSON file to write (new).")
@click.argument("corpus", nargs=-1, required=True, type=click.Path(exists=True))
def draft_vocab(target: str, size: int, output: str, corpus: tuple[str, ...]) -> None:
    """Count the target's tokens over CORPUS (text files, directories walked) and write its SIZE most
    frequent, with its end-of-generation tokens, as a drafting vocabulary for --draft-vocab."""
    from .draft_vocab import make_draft_vocab, refuse_existing, save_draft_vocab

    try:
        refuse_existing(output)  # before the counting, not only after it
        vocab = make_draft_vocab(target, list(corpus), size)
        save_draft_vocab(vocab, output)
    except (ValueError, RuntimeError, OSError) as e:
        _fail(e)
    click.echo(
        f"wrote {output}: {len(vocab['tokens'])} of {vocab['n_vocab']} tokens, "
        f"{vocab['coverage']:.1%} of the corpus's {vocab['corpus_tokens']:,} tokens "
        f"({vocab['corpus_files']} files)"
    )


if __name__ == "__main__":
    main()
