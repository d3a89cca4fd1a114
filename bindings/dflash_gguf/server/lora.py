"""llama-server's LoRA routes and fields: GET /lora-adapters lists the target's adapters with the server's
scales, POST /lora-adapters sets those scales, and a request's own `lora` field sets them for its
generation alone; an adapter a list leaves out is at scale 0."""

from __future__ import annotations

from typing import Any

from ..speculative import SpeculativeLlama
from .requests import BadRequest

NAMES = ("task_name", "prompt_prefix")  # the adapter file's adapter.lora.* texts GET /lora-adapters lists


def adapter_list(llm: SpeculativeLlama) -> list[dict[str, Any]]:
    """GET /lora-adapters' entries: id, path, scale, and the task name and prompt prefix the adapter's file
    names (adapter.lora.task_name / prompt_prefix, "" when it names none)."""
    import gguf

    out = []
    for adapter in llm.lora_adapters:
        fields = gguf.GGUFReader(adapter["path"], "r").fields
        meta = {k: fields[f"adapter.lora.{k}"].contents() if f"adapter.lora.{k}" in fields else "" for k in NAMES}
        out.append({**adapter, **meta})
    return out


def listed_scales(entries: Any, n_adapters: int) -> list[float]:
    """The scales a list of {"id", "scale"} gives the adapters (those it leaves out: 0); BadRequest for what
    is no such list."""
    if not isinstance(entries, list):
        raise BadRequest("'lora' must be an array of objects with 'id' and 'scale' fields")
    scales = [0.0] * n_adapters
    for e in entries:
        if not isinstance(e, dict) or isinstance(e.get("id", -1), bool) or not isinstance(e.get("id", -1), int):
            raise BadRequest(f"each LoRA entry must be {{'id': int, 'scale': number}}, got {e!r:.80}")
        scale = e.get("scale", 0.0)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise BadRequest(f"a LoRA entry's scale must be a number, got {scale!r:.80}")
        if 0 <= e.get("id", -1) < n_adapters:  # other ids name no adapter (llama-server's: ignored)
            scales[e["id"]] = float(scale)
    return scales
