"""The checkpoint's tokenizer (with its chat template), loaded offline from the model directory."""

from __future__ import annotations

import logging
from pathlib import Path

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(model_dir: Path):
    """A ``transformers`` tokenizer, or None when the directory has no tokenizer files."""
    if not any((Path(model_dir) / name).exists() for name in _TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files: only token-id prompts will work", model_dir)
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot load the tokenizer in {model_dir}: {exc}") from None
