"""Structured-output grammars: `StructuredOutputs` → a compiled llguidance matcher, cached.

Owns: the translation of each constraint kind into an llguidance grammar (JSON schema, any JSON
object, regex, choice, Lark / GBNF grammar), its validation (a bad spec is a ParamError naming
`structured_outputs`, or the OpenAI field it came from), and a cache of compiled matchers keyed
by the constraint, so each distinct schema is compiled once and every request gets a cheap
`deep_copy` of the compiled matcher.

The grammar engine is llguidance (Microsoft, PyPI `llguidance`; vLLM's `guidance` backend): an
Earley parser over the tokenizer's token trie that yields, per step, the set of allowed next
tokens as a bitmask (see `engine.structured.mask`). JSON is generated without free whitespace
(`whitespace_flexible: false`): a small model given the freedom loops on blank lines. An object
schema that does not say `additionalProperties` allows no other keys (`closed_objects`), as
vLLM's default backend generates.

In: `StructuredOutputs` (pure data from `scheduler.request`) and an HF tokenizer.
Out: `LLMatcher` objects, one per sequence, advanced by the model runner with each sampled token.
Thread-safe: the engine compiles on a worker thread while the step loop creates matchers.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import llguidance
import llguidance.numpy

from scheduler.request import ParamError, StructuredOutputs

JSON_OPTIONS = {"whitespace_flexible": False}
_ANY_OBJECT = '{"type": "object"}'


def grammar_text(so: StructuredOutputs, param: str = "structured_outputs") -> str:
    """The llguidance grammar (a JSON string) for a constraint; see `_grammar_text`.

    Raises: ParamError naming `param` (llguidance's own errors are wrapped)."""
    try:
        return _grammar_text(so, param)
    except ParamError:
        raise
    except Exception as e:
        raise ParamError(f"invalid {so.kind} constraint: {e}", param) from None


def closed_objects(schema):
    """A copy of a JSON schema in which every object schema that lists `properties` (or
    `patternProperties`) and says nothing of `additionalProperties` allows no other keys — what
    vLLM's default structured-output backend (xgrammar, strict mode) generates; JSON Schema's
    own default (any other key) let a small model add keys, and repeat them, until max_tokens.
    An explicit `additionalProperties` is kept."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if "additionalProperties" not in out and ("properties" in out or "patternProperties" in out):
        out["additionalProperties"] = False
    return out


def _grammar_text(so: StructuredOutputs, param: str) -> str:
    """The llguidance grammar (a JSON string) for a constraint.

    Raises: ParamError naming `param` when the spec is not even well-formed (JSON that does not
    parse, a choice list that is not a non-empty list of strings, an empty regex or grammar).
    Deeper problems (an unsupported schema keyword, a bad regex) surface in `compile`.
    """
    if so.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=JSON_OPTIONS)
    if so.kind == "json":
        try:
            schema = json.loads(so.spec)
        except ValueError as e:
            raise ParamError(f"the JSON schema is not valid JSON: {e}", param) from None
        if not isinstance(schema, (dict, bool)):
            raise ParamError("the JSON schema must be an object", param)
        return llguidance.LLMatcher.grammar_from_json_schema(closed_objects(schema),
                                                             defaults=JSON_OPTIONS)
    if so.kind == "choice":
        try:
            choices = json.loads(so.spec)
        except ValueError:
            choices = None
        if (not isinstance(choices, list) or not choices
                or not all(isinstance(c, str) for c in choices)):
            raise ParamError("choice must be a non-empty list of strings", param)
        return llguidance.grammar_from("choice", json.dumps(choices))
    if not so.spec:
        raise ParamError(f"the {so.kind} must not be empty", param)
    if so.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.spec)
    return llguidance.grammar_from("grammar", so.spec)      # Lark, or GBNF (converted)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and caches the compiled matchers (LRU).

    Args: `tokenizer` an HF fast tokenizer, or `load_tokenizer` a function that returns one at
    the first compile (the engine core loads its tokenizer only then); `vocab_size` the model's
    logits width (tokens; may exceed the tokenizer's size); `cache_size` distinct constraints
    kept compiled.
    llguidance's view of the tokenizer (its token trie: ~0.5 s for a 49 k vocabulary on a 2-core
    AVX2 host) is built by the first compile, as vLLM builds its structured-output backend at
    the first request that asks for one: an engine or server that never sees a constraint does
    not pay for it at start. The build holds the GIL (measured: another thread ran at 3 % of its
    speed meanwhile), so the first constraint a process sees stalls that process's other work
    once, for about that long; not built in the background after start for the same reason.
    Counters: `compiles`, `hits`, `compile_seconds` (total wall time spent compiling).
    """

    def __init__(self, tokenizer=None, vocab_size: int | None = None, cache_size: int = 256,
                 load_tokenizer: Callable[[], object] | None = None) -> None:
        self._load_hf = load_tokenizer if tokenizer is None else (lambda: tokenizer)
        self._n_vocab = vocab_size
        self._ll_tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredOutputs, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = self.hits = 0
        self.compile_seconds = 0.0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer, built at the first use (thread-safe)."""
        with self._tokenizer_lock:
            if self._ll_tokenizer is None:
                import llguidance.hf       # imports transformers: not before a constraint needs it

                self._ll_tokenizer = llguidance.hf.from_tokenizer(self._load_hf(),
                                                                  n_vocab=self._n_vocab)
            return self._ll_tokenizer

    @property
    def vocab_size(self) -> int:
        """The logits width the masks cover (tokens)."""
        return self._n_vocab or self.tokenizer.vocab_size

    def cached(self, so: StructuredOutputs) -> bool:
        """Whether `so` is compiled already (a request using it needs no wait)."""
        with self._lock:
            return so in self._cache

    def compile(self, so: StructuredOutputs, param: str = "structured_outputs"
                ) -> llguidance.LLMatcher:
        """The compiled matcher for `so` (shared: copy it before use; see `matcher`).

        Raises: ParamError naming `param` with llguidance's message when the constraint is
        invalid or unsupported (e.g. "Invalid type: strin", a regex parse error), or when
        llguidance cannot read the tokenizer.
        """
        with self._lock:
            m = self._cache.get(so)
            if m is not None:
                self._cache.move_to_end(so)
                self.hits += 1
                return m
        t0 = time.perf_counter()
        grammar = grammar_text(so, param)
        try:
            tokenizer = self.tokenizer
        except Exception as e:         # a tokenizer llguidance cannot read: no constraint at all
            raise ParamError(f"structured outputs are not available for this model's "
                             f"tokenizer: {e}", param) from None
        try:
            m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        except Exception as e:         # llguidance raises ValueError (and others) on bad input
            raise ParamError(f"invalid {so.kind} constraint: {e}", param) from None
        probe = m.deep_copy()        # the first mask finds grammars that can match nothing
        llguidance.numpy.fill_next_token_bitmask(
            probe, llguidance.numpy.allocate_token_bitmask(1, self.vocab_size), 0)
        if m.is_error():
            raise ParamError(f"invalid {so.kind} constraint: {m.get_error().strip()}", param)
        if probe.is_error():
            reason = probe.get_error().strip().splitlines()[0]
            raise ParamError(f"invalid {so.kind} constraint: it can match no text ({reason})",
                             param)
        with self._lock:
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - t0
            self._cache[so] = m
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return m

    def matcher(self, so: StructuredOutputs, consumed: list[int] = ()) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence, advanced past `consumed` token ids (a sequence
        resumed after recompute preemption). Raises ParamError as `compile` does."""
        m = self.compile(so).deep_copy()
        if consumed:
            m.consume_tokens(list(consumed))
        return m
