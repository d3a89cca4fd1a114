"""dflash_convert: DFlash / DFlash2 drafter checkpoints -> GGUF drafters for llama.cpp (arch ``dflash``).

Library use::

    from dflash_convert import Options, convert
    result = convert(Options(draft_dir=Path("drafter"), target=Path("target.gguf"), outtype="q8_0"))
"""

from __future__ import annotations

__version__ = "0.1.0"

from .convert import Options, Plan, Result, build_plan, convert, execute  # noqa: E402
from .errors import ConversionError  # noqa: E402

__all__ = ["ConversionError", "Options", "Plan", "Result", "build_plan", "convert", "execute", "__version__"]
