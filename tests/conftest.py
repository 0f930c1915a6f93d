"""Session fixtures: the embedded model (converted once into the cache) and its tokenizer.

The model cache is `$CONTINUUM_CACHE` (default `~/.cache/continuum`), shared with `make serve`,
so a machine converts the GGUF once.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_dir():
    from engine.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
