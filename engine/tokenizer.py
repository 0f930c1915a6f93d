"""Loading a model directory's tokenizer: the class `AutoTokenizer` would pick, without what
`AutoTokenizer` imports to pick it.

Owns `load_tokenizer(model_dir)`, which the API process calls at start and the engine core at
the first use it has for one (a grammar, a draft model's vocabulary check), and
`eos_token_id(model_dir)`, all that the engine core needs of the tokenizer to start. In: a
checkpoint directory (`tokenizer.json`, `tokenizer_config.json`, `config.json`). Out: a
transformers tokenizer (`PreTrainedTokenizerBase`), or a token id.

Why: transformers 5's `AutoTokenizer.from_pretrained` always builds the model's `AutoConfig`
first, to choose the tokenizer class from the model type. That imports the model family's
configuration module and, through it, `torch.distributed.tensor` and sympy, and scans every
model package's `__init__` (`transformers.models`): on a 2-core AMD EPYC (Zen 3), 1.6 s of a
3.5 s first load after torch, in every process that starts an engine. For a directory whose
`tokenizer_config.json` names `TokenizersBackend` (what transformers 5 writes for a
`tokenizer.json`-only tokenizer, as the GGUF conversion in `engine/loader.py` does), no remote
code (`auto_map`) and a model type that `AutoTokenizer` maps to no other class (`llama`:
transformers 5.25 `tokenization_auto.py`, which lists the types whose declared class it
overrides — `qwen2` among them — and treats Mistral's formats apart), `AutoTokenizer` returns
`TokenizersBackend.from_pretrained(dir)`; this module calls that directly. Anything else goes
through `AutoTokenizer`. tests/test_loader.py checks that both give the same tokenizer for the
embedded model.

`eos_token_id` reads the same files with the `tokenizers` library alone (0.15 s, no
transformers: importing it takes ~1 s more in a process that has torch), so that a server's
engine core starts without transformers.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

# model types for which AutoTokenizer keeps a declared `TokenizersBackend` (see above)
DIRECT_MODEL_TYPES = frozenset({"llama"})


def direct_class(model_dir: str | Path) -> bool:
    """Whether `load_tokenizer` may build `TokenizersBackend` directly for `model_dir` (see the
    module docstring); False when either JSON file is missing or unreadable."""
    path = Path(model_dir)
    try:
        tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(tokenizer_config, dict) or not isinstance(config, dict):
        return False
    return (tokenizer_config.get("tokenizer_class") == "TokenizersBackend"
            and "auto_map" not in tokenizer_config and "auto_map" not in config
            and config.get("model_type") in DIRECT_MODEL_TYPES)


def eos_token_id(model_dir: str | Path) -> int | None:
    """`load_tokenizer(model_dir).eos_token_id`: for a directory `direct_class` accepts, with no
    `special_tokens_map.json` or `added_tokens.json` (which transformers reads over
    `tokenizer_config.json`), the id `tokenizer.json` gives `tokenizer_config.json`'s
    `eos_token` (transformers' `convert_tokens_to_ids`); otherwise, or where that token is not
    in the vocabulary, the loaded tokenizer's. Raises what `load_tokenizer` raises."""
    path = Path(model_dir)
    if direct_class(path) and not (path / "special_tokens_map.json").exists() \
            and not (path / "added_tokens.json").exists():
        token = json.loads((path / "tokenizer_config.json").read_text()).get("eos_token")
        if isinstance(token, dict):                       # a serialised AddedToken
            token = token.get("content")
        if isinstance(token, str):
            tokenizer_json = path / "tokenizer.json"
            stat = tokenizer_json.stat()
            found = _token_id(str(tokenizer_json), stat.st_mtime_ns, stat.st_size, token)
            if found is not None:
                return found
    return load_tokenizer(path).eos_token_id


@lru_cache(maxsize=16)
def _token_id(tokenizer_json: str, mtime_ns: int, size: int, token: str) -> int | None:
    """`token`'s id in the `tokenizers` file `tokenizer_json`, or None; cached per file version
    (`mtime_ns`, `size`): parsing the file takes ~0.1 s, once per engine built in a process."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer_json).token_to_id(token)


def load_tokenizer(model_dir: str | Path):
    """The tokenizer of `model_dir`, as `AutoTokenizer.from_pretrained(model_dir)` returns it.

    Raises what transformers raises for an unreadable tokenizer (OSError, ValueError, ...)."""
    if direct_class(model_dir):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))
