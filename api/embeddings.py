"""`POST /v1/embeddings` in OpenAI's shape, served by the model repository's text-in / vector-out
models through the same runtimes and dynamic batchers as `POST /v2/models/{m}/infer`.

Owns: the embeddings request body (`EmbeddingRequest`), which repository models count as
embedding models (`describe`: exactly one TYPE_STRING input of dims [1] or [-1], exactly one
TYPE_FP32 output of one dimension), the tokenizer a model declares for this layer, and the
`/v1/models` cards of those models (`model_cards`, called by `api.server`'s route).

Data flow: JSON body → `EmbeddingRequest` (pydantic; a malformed `input` is a 400 naming
`input`) → the model (404 unknown, 400 not text-in / vector-out, 503 still loading) → texts and
their token counts (`prepare_inputs`: token ids are decoded to text with the model's tokenizer;
limits) → one batch-1 v2 request per text (BYTES [1, 1]) handed to the model's
`runtime.submit`, exactly as the v2 route does → FP32 vectors [dims] → `dimensions`
truncation → JSON floats or base64 of little-endian float32 → `{"object": "list", "data",
"model", "usage"}` (vectors float32, `usage` in tokens). Like the v2 route, a client that
leaves does not stop its texts already submitted.

Batching: each text is its own batch-1 request, so the model's dynamic batcher packs texts of
this call, of other OpenAI callers and of v2 callers into the same batches, up to exactly
`max_batch_size` (a chunk of N rows could only share a batch with requests of at most
`max_batch_size - N` rows, and a full chunk with none); and a tokenizer step that pads the
texts of one request to the longest never pads a single text. A call keeps at most
`WINDOW_BATCHES × max_batch_size` of its texts in flight (enough to keep every step of a
three-step ensemble busy), so a 2048-input call neither floods the queue (nor trips
`max_queue_size`) nor makes later callers wait behind all of it.

Declaring a tokenizer (config.pbtxt `parameters`, all string values, all optional):
- `tokenizer`: a Hugging Face `tokenizers` file (tokenizer.json) the model itself uses:
  `PACKAGE:PATH` is PATH inside the installed Python package PACKAGE (found without importing
  it, as the example `text_tokenizer` model finds it), anything else a path absolute or relative
  to the model's folder; a folder means its tokenizer.json. Nothing is downloaded. Loaded once,
  with padding and truncation off. Without it, `usage` counts 0 tokens (unknown) and token-id
  input is refused (400).
- `max_input_tokens`: the most tokens (special tokens included) one input may have; a longer
  input is a 400, as with OpenAI and vLLM, never silently truncated. Needs `tokenizer`.
- `matryoshka_dimensions`: comma-separated sizes the model was trained to be truncated to
  (vLLM's name for it).

`dimensions` (vLLM's rule): equal to the model's native size it is a no-op; another value is
allowed only when listed in `matryoshka_dimensions`, and the vector is then cut to its first
`dimensions` values and L2-normalised again (as OpenAI's text-embedding-3 returns them); else
400 naming `dimensions`. Token-id input (a list of ids, or a list of such lists) is decoded with
the declared tokenizer (special tokens skipped) and embedded as that text, so it is batched with
text callers; its `usage` counts the tokens of that text as the model sees them.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from api.errors import APIError, bad_request
from scheduler.request import ParamError

MAX_INPUTS = 2048          # inputs per request (OpenAI's limit)
WINDOW_BATCHES = 4         # a call's texts in flight: this many times the model's max_batch_size
OFFLOAD_INPUTS = 32        # from this many inputs on, tokenizing and JSON run in a thread,
OFFLOAD_CHARS = 1 << 16    # and from this many characters (or token ids) in all
INPUT_SHAPE = ("input must be a string, a list of strings, a list of token ids or a list of "
               "lists of token ids")


def _is_id(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_input(value):
    """Shape and size of `input`; returns it unchanged. Raises ParamError naming `input`: not
    one of the four shapes, empty (string, list, or an item of a list), more than
    `MAX_INPUTS` inputs."""
    if isinstance(value, str):
        if not value:
            raise ParamError("input must not be an empty string", "input")
        return value
    if not isinstance(value, list) or not value:
        raise ParamError("input must not be an empty list" if isinstance(value, list)
                         else INPUT_SHAPE, "input")
    if all(_is_id(x) for x in value):
        return value                      # one input given as token ids
    if len(value) > MAX_INPUTS:
        raise ParamError(f"input has {len(value)} items; at most {MAX_INPUTS} inputs are "
                         "allowed per request", "input")
    texts = all(isinstance(x, str) for x in value)
    if not texts and not all(isinstance(x, list) and all(_is_id(y) for y in x) for x in value):
        raise ParamError(INPUT_SHAPE, "input")
    empty = next((i for i, x in enumerate(value) if not x), None)
    if empty is not None:
        what = "an empty string" if texts else "an empty list of token ids"
        raise ParamError(f"input[{empty}] must not be {what}", "input")
    return value


class EmbeddingRequest(BaseModel):
    """`POST /v1/embeddings` body (OpenAI's fields; unknown fields are a 400)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="a string, a list of strings, a list of token ids or a list of such lists; "
                    f"at most {MAX_INPUTS} inputs, none empty")
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value):
        return check_input(value)

    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding to return: a text, or a list of token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if all(isinstance(x, int) for x in self.input):
            return [list(self.input)]
        return list(self.input)


@dataclass(frozen=True)
class EmbeddingModel:
    """A repository model that maps one text to one FP32 vector, as this layer uses it."""

    name: str
    runtime: object                  # ModelRuntime or EnsembleRuntime (its `submit`)
    input: str                       # the TYPE_STRING input's name
    output: str                      # the TYPE_FP32 output's name
    max_batch_size: int              # 0: the model does not batch (input shape [1])
    dims: int                        # native vector size; -1 when the config leaves it open
    model_dir: Path
    tokenizer_spec: str | None       # config parameter `tokenizer`
    max_input_tokens: int | None     # config parameter `max_input_tokens`
    matryoshka: tuple[int, ...]      # config parameter `matryoshka_dimensions`


def _io(config) -> tuple[str, str, int] | None:
    """(input name, output name, native dims) when `config` is text-in / vector-out."""
    from triton_compat.core.config import wire_datatype

    if len(config.input) != 1 or len(config.output) != 1:
        return None
    inp, out = config.input[0], config.output[0]
    if wire_datatype(inp.data_type) != "BYTES" or list(inp.dims) not in ([1], [-1]):
        return None
    if wire_datatype(out.data_type) != "FP32" or len(out.dims) != 1:
        return None
    return inp.name, out.name, int(out.dims[0])


def _parameter(config, key: str) -> str | None:
    return config.parameters[key].string_value if key in config.parameters else None


def _positive_ints(config, key: str) -> tuple[int, ...]:
    raw = _parameter(config, key) or ""
    try:
        values = tuple(int(v) for v in raw.replace(",", " ").split())
    except ValueError:
        values = (0,)
    if any(v < 1 for v in values):
        raise APIError(500, f"model '{config.name}': config.pbtxt parameter '{key}' must hold "
                            f"positive integers, got {raw!r}", "internal_error")
    return values


def describe(name: str, runtime, model_dir: Path) -> EmbeddingModel | None:
    """The embedding view of a loaded model, or None when it is not text-in / vector-out.

    Raises APIError(500) for a malformed `max_input_tokens` / `matryoshka_dimensions`."""
    io = _io(runtime.config)
    if io is None:
        return None
    limit = _positive_ints(runtime.config, "max_input_tokens")
    return EmbeddingModel(name, runtime, io[0], io[1], runtime.config.max_batch_size, io[2],
                          model_dir, _parameter(runtime.config, "tokenizer") or None,
                          limit[0] if limit else None,
                          _positive_ints(runtime.config, "matryoshka_dimensions"))


def model_cards(state) -> list[dict]:
    """`/v1/models` entries of the repository's ready embedding models (the LLM's own name
    excluded); [] without a repository or while it loads."""
    repo = state.repository
    if repo is None:
        return []
    from triton_compat.errors import InferError

    llm = state.served_model_name if state.engine_config is not None else None
    cards = []
    for name in dict.fromkeys(e["name"] for e in repo.index(ready_only=True)):
        try:
            config = repo.runtime(name).config
        except InferError:               # unloaded since the index was read
            continue
        if name != llm and _io(config) is not None:
            cards.append({"id": name, "object": "model", "created": int(state.started),
                          "owned_by": "continuum"})
    return cards


def _not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model",
                    "model_not_found")


def _not_embedding(name: str) -> APIError:
    return bad_request(f"model '{name}' does not serve embeddings: /v1/embeddings needs a model "
                       "with one TYPE_STRING input and one TYPE_FP32 output of one dimension",
                       "model")


def embedding_model(state, name: str) -> EmbeddingModel:
    """The embedding model called `name`. Raises APIError: 404 unknown, 400 not an embedding
    model (the LLM included), 503 the repository or the model is not ready (yet)."""
    from triton_compat.errors import InferError

    if state.engine_config is not None and name == state.served_model_name:
        raise _not_embedding(name)             # the LLM (also with no model repository)
    repo = state.repository
    if repo is None:
        if state.repository_error:
            raise APIError(503, f"the model repository failed to load: "
                                f"{state.repository_error}", "service_unavailable")
        raise APIError(503, "the model repository is still loading", "service_unavailable",
                       headers={"Retry-After": "5"})
    try:
        runtime = repo.runtime(name)
    except InferError as e:
        if e.status == 404:
            raise _not_found(name) from None
        raise APIError(503, e.message, "service_unavailable", "model", "model_not_ready",
                       headers={"Retry-After": "5"}) from None
    model = describe(name, runtime, repo.root / name)
    if model is None:
        raise _not_embedding(name)
    return model


_tokenizers: dict[tuple[Path, str], object] = {}
_tokenizers_lock = threading.Lock()


def tokenizer_file(spec: str, model_dir: Path) -> Path:
    """The tokenizer.json a `tokenizer` parameter names (module docstring). Raises ValueError."""
    package, sep, rest = spec.partition(":")
    if sep and package and all(p.isidentifier() for p in package.split(".")):
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise ValueError(f"the Python package {package} is not installed")
        path = Path(list(found.submodule_search_locations)[0]) / rest
    else:
        path = model_dir / spec          # an absolute spec replaces model_dir
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no tokenizer file at {path}")
    return path


def load_tokenizer(model: EmbeddingModel):
    """The model's `tokenizers.Tokenizer` (padding and truncation off), None when it declares
    none. Cached per model folder and spec. Raises APIError(500) when it cannot be loaded."""
    if model.tokenizer_spec is None:
        return None
    key = (model.model_dir, model.tokenizer_spec)
    with _tokenizers_lock:
        if key not in _tokenizers:
            from tokenizers import Tokenizer
            try:
                tok = Tokenizer.from_file(str(tokenizer_file(model.tokenizer_spec,
                                                             model.model_dir)))
            except Exception as e:
                raise APIError(500, f"model '{model.name}': cannot load the tokenizer its "
                                    f"config.pbtxt declares ({model.tokenizer_spec!r}): {e}",
                               "internal_error") from None
            tok.no_padding()
            tok.no_truncation()
            _tokenizers[key] = tok
        return _tokenizers[key]


def _too_long(model: EmbeddingModel, i: int, count: int) -> APIError:
    return bad_request(f"This model's maximum context length is {model.max_input_tokens} "
                       f"tokens. However, input[{i}] has {count} tokens. Please reduce the "
                       "length of the input.", "input")


def _decode_ids(model: EmbeddingModel, tokenizer, i: int, ids: list[int]) -> str:
    if tokenizer is None:
        raise bad_request(f"model '{model.name}' declares no tokenizer (config.pbtxt parameter "
                          "'tokenizer'), so it takes text input only, not token ids", "input")
    if model.max_input_tokens and len(ids) > model.max_input_tokens:
        raise _too_long(model, i, len(ids))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"input[{i}] holds token id {bad}, outside the vocabulary of model "
                          f"'{model.name}' (0..{vocab - 1})", "input")
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if not text:
        raise bad_request(f"input[{i}]: the token ids decode to an empty text", "input")
    return text


def prepare_inputs(model: EmbeddingModel,
                   items: list[str | list[int]]) -> tuple[list[bytes], list[int]]:
    """UTF-8 texts to embed (token ids decoded) and each one's token count (special tokens
    included; 0 without a tokenizer). Raises APIError: 400 naming `input` for token ids
    without a tokenizer or outside its vocabulary, or an input longer than `max_input_tokens`;
    500 when the declared tokenizer cannot be loaded."""
    tokenizer = load_tokenizer(model)
    texts = [item if isinstance(item, str) else _decode_ids(model, tokenizer, i, item)
             for i, item in enumerate(items)]
    encoded = [t.encode("utf-8", "replace") for t in texts]    # lone surrogates from JSON
    if tokenizer is None:
        return encoded, [0] * len(encoded)
    if len(encoded) == 1:              # encode_batch costs more for one text
        counts = [len(tokenizer.encode(encoded[0].decode("utf-8")).ids)]
    else:
        counts = [len(e.ids) for e in tokenizer.encode_batch(
            [b.decode("utf-8") for b in encoded])]
    for i, n in enumerate(counts):
        if model.max_input_tokens and n > model.max_input_tokens:
            raise _too_long(model, i, n)
    return encoded, counts


def check_dimensions(model: EmbeddingModel, dimensions: int | None) -> None:
    """Raises APIError(400) naming `dimensions` unless the model can return that size (module
    docstring); checked before anything runs."""
    if dimensions is None or dimensions == model.dims:
        return
    if not model.matryoshka:
        native = f"its native {model.dims}" if model.dims > 0 else "its native size"
        raise bad_request(f"model '{model.name}' does not support 'dimensions' other than "
                          f"{native} (its config.pbtxt declares no 'matryoshka_dimensions')",
                          "dimensions")
    if dimensions not in model.matryoshka:
        raise bad_request(f"model '{model.name}' supports 'dimensions' in "
                          f"{sorted(set(model.matryoshka))} only, got {dimensions}",
                          "dimensions")


def _from_infer_error(e, model: str) -> APIError:
    if e.status == 404:
        return _not_found(model)
    if e.status == 503:
        return APIError(503, e.message, "service_unavailable", headers={"Retry-After": "1"})
    if e.status == 400:
        return bad_request(e.message, "input")
    return APIError(e.status, e.message, "internal_error")


async def embed_one(model: EmbeddingModel, text: bytes) -> np.ndarray:
    """One text (UTF-8) through the model's runtime as a batch-1 v2 request → float32 [dims].
    Raises APIError: the runtime's refusals (503 queue full or unloading), 500 a model
    failure or a vector that is not `dims` finite values."""
    from triton_compat.core.backends import BackendRequest
    from triton_compat.errors import InferError

    array = np.array([[text]] if model.max_batch_size > 0 else [text], dtype=object)
    try:
        future = model.runtime.submit(BackendRequest({model.input: array}, [model.output]),
                                      {model.input: "BYTES"})
        outputs = await asyncio.wrap_future(future)   # as the v2 route
    except InferError as e:
        raise _from_infer_error(e, model.name) from None
    except Exception as e:                 # a model bug: a 500 in OpenAI's shape
        raise APIError(500, f"{type(e).__name__}: {e}", "internal_error") from None
    vector = np.asarray(outputs[model.output], dtype=np.float32).reshape(-1)
    if (model.dims > 0 and vector.size != model.dims) or not np.isfinite(vector).all():
        raise APIError(500, f"model '{model.name}' returned {vector.size} values (finite: "
                            f"{bool(np.isfinite(vector).all())}), not {model.dims} finite ones",
                       "internal_error")
    return vector


async def embed_texts(model: EmbeddingModel, texts: list[bytes]) -> list[np.ndarray]:
    """Every text as its own batch-1 request, at most `WINDOW_BATCHES × max_batch_size` in
    flight; vectors in input order. The first failure is raised (APIError) and the texts not
    yet submitted are dropped."""
    if len(texts) == 1:
        return [await embed_one(model, texts[0])]
    window = asyncio.Semaphore(WINDOW_BATCHES * max(1, model.max_batch_size))
    failed: list[APIError] = []

    async def one(text: bytes):
        async with window:
            if failed:
                return None
            try:
                return await embed_one(model, text)
            except APIError as e:
                failed.append(e)
                return None

    vectors = await asyncio.gather(*(one(t) for t in texts))
    if failed:
        raise failed[0]
    return vectors


def render(name: str, vectors: list[np.ndarray], encoding: str, dimensions: int | None,
           counts: list[int]) -> bytes:
    """The response body (JSON bytes). `dimensions` below the native size cuts each vector
    and L2-normalises it again; base64 is the float32 values, little-endian."""
    out = []
    for v in vectors:
        if dimensions is not None and dimensions < v.size:
            v = v[:dimensions]
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        v = v.astype("<f4")
        out.append(base64.b64encode(v.tobytes()).decode("ascii") if encoding == "base64"
                   else v.tolist())
    total = sum(counts)
    return json.dumps({
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(out)],
        "model": name, "usage": {"prompt_tokens": total, "total_tokens": total}},
        separators=(",", ":")).encode()


def install(app, state, parse) -> None:
    """Add `POST /v1/embeddings` to `app` (so `--api-key` and the lifecycle gate cover it).

    `state` is the server's `ServerState` (repository, LLM name, body size limit); `parse` is
    the server's `async parse(request, pydantic model, limit)`, which answers malformed bodies
    with OpenAI's 400 naming the field."""
    body_doc = {"required": True, "content": {"application/json": {
        "schema": EmbeddingRequest.model_json_schema()}}}

    @app.post("/v1/embeddings", openapi_extra={"requestBody": body_doc})
    async def create_embeddings(request: Request):
        body = await parse(request, EmbeddingRequest, state.http_max_input_size)
        model = embedding_model(state, body.model)
        check_dimensions(model, body.dimensions)
        items = body.inputs()
        offload = (len(items) >= OFFLOAD_INPUTS
                   or sum(len(x) for x in items) >= OFFLOAD_CHARS)
        texts, counts = (await asyncio.to_thread(prepare_inputs, model, items) if offload
                         else prepare_inputs(model, items))
        vectors = await embed_texts(model, texts)
        args = (body.model, vectors, body.encoding_format or "float", body.dimensions, counts)
        payload = await asyncio.to_thread(render, *args) if offload else render(*args)
        return Response(payload, media_type="application/json")
