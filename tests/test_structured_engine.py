"""Structured outputs inside the engine: a compiling grammar never stalls other requests, the
mask survives recompute preemption and n > 1, and the grammar cache compiles each constraint
once. Real model, offline `LLMEngine`."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.structured.grammar import closed_objects, grammar_text
from scheduler.request import ParamError, SamplingParams, StructuredOutputs

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "days": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                             "maximum": 31},
                                  "minItems": 2, "maxItems": 4}},
          "required": ["city", "days"], "additionalProperties": False}
JSON = StructuredOutputs("json", json.dumps(SCHEMA))


def chat(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(kv_cache_memory=0.1, max_model_len=512, device="cpu",
                                  dtype="float32"))


def text_of(engine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def test_a_compiling_grammar_does_not_stall_other_requests(engine, tokenizer, monkeypatch):
    release = threading.Event()
    compile_ = engine.grammars.compile

    def slow_compile(so, param="structured_outputs"):
        release.wait(30)
        return compile_(so, param)

    monkeypatch.setattr(engine.grammars, "compile", slow_compile)
    slow = StructuredOutputs("regex", "[a-z]{3} slow")       # never compiled before
    engine.add_request("free", chat(tokenizer, "Say hi."),
                       SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    engine.add_request("constrained", chat(tokenizer, "Say hi."),
                       SamplingParams(max_tokens=8, temperature=0, structured_outputs=slow))
    done = {}
    for _ in range(10):
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert len(done["free"]) == 6 and "constrained" not in done     # ran while it waited
    release.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    text = text_of(engine, done["constrained"])
    assert len(text) == 8 and text[:3].isalpha() and text.endswith(" slow")


def test_mask_survives_recompute_preemption_and_forks(tokenizer):
    eng = LLMEngine(EngineConfig(num_gpu_blocks_override=12, max_model_len=128, device="cpu",
                                 dtype="float32", max_num_batched_tokens=64, max_num_seqs=6))
    prompts = [chat(tokenizer, f"Plan {k} days in a city, as JSON.") for k in range(4)]
    params = SamplingParams(max_tokens=60, temperature=0.8, seed=5, n=2,
                            structured_outputs=JSON)
    outs = eng.generate(prompts, params)
    assert eng.scheduler.counters.num_preemptions > 0, "the pool must force preemption"
    for choices in outs:
        for ids in choices:
            jsonschema.validate(json.loads(text_of(eng, ids)), SCHEMA)
    roomy = LLMEngine(EngineConfig(kv_cache_memory=0.1, max_model_len=128, device="cpu",
                                   dtype="float32", max_num_batched_tokens=64, max_num_seqs=6))
    assert roomy.generate(prompts, params) == outs        # preemption changes nothing


def test_each_constraint_compiles_once(engine, tokenizer):
    so = StructuredOutputs("choice", '["left", "right"]')
    before = engine.grammars.compiles
    outs = engine.generate([chat(tokenizer, "Left or right?")] * 3,
                           SamplingParams(max_tokens=4, temperature=0, structured_outputs=so))
    assert engine.grammars.compiles == before + 1
    assert {text_of(engine, o[0]) for o in outs} <= {"left", "right"}


@pytest.mark.parametrize("so", [
    StructuredOutputs("json", "{not json"), StructuredOutputs("choice", "[1, 2]"),
    StructuredOutputs("regex", ""),
])
def test_malformed_specs_fail_at_add(engine, so):
    with pytest.raises(ParamError):
        grammar_text(so)
    with pytest.raises(ParamError):
        engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=so))
    assert "bad" not in engine.scheduler.requests


def test_a_grammar_that_fails_to_compile_fails_only_its_request(engine, tokenizer):
    bad = StructuredOutputs("json", json.dumps({"type": "object",
                                                "properties": {"a": {"type": "strin"}}}))
    engine.add_request("bad", chat(tokenizer, "x"), SamplingParams(structured_outputs=bad))
    engine.add_request("good", chat(tokenizer, "x"), SamplingParams(max_tokens=3, temperature=0,
                                                                    ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad"].outputs[0].finish_reason == "error"
    assert "strin" in finished["bad"].error
    assert finished["good"].outputs[0].finish_reason == "length"


def test_object_schemas_without_additional_properties_are_closed(engine, tokenizer):
    """As vLLM's default backend: an object schema listing properties and silent on
    `additionalProperties` allows no other key, at any depth; an explicit true stays open. The
    model, asked for a person, then stops after the listed keys."""
    schema = {"type": "object", "properties": {
        "name": {"type": "string"},
        "pets": {"type": "array", "items": {"type": "object",
                                            "properties": {"kind": {"type": "string"}}}},
        "extra": {"type": "object", "properties": {}, "additionalProperties": True}},
        "required": ["name"]}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["pets"]["items"]["additionalProperties"] is False
    assert closed["properties"]["extra"]["additionalProperties"] is True
    assert "additionalProperties" not in schema                   # the caller's is untouched
    person = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}}, "required": ["name"]}
    so = StructuredOutputs("json", json.dumps(person))
    [[ids]] = engine.generate([chat(tokenizer, "Give me a person as JSON.")],
                              SamplingParams(max_tokens=60, temperature=0, structured_outputs=so))
    value = json.loads(text_of(engine, ids))
    assert set(value) <= {"name", "age"} and "name" in value


def test_the_token_trie_is_built_by_the_first_constraint_and_a_bad_tokenizer_is_a_param_error(
        tokenizer):
    """llguidance's view of the tokenizer costs ~0.5 s, so an engine builds it at the first
    constraint, not at start; a tokenizer llguidance cannot read refuses constraints with a
    ParamError (a 400 in the servers), and a good one compiles after it."""
    from engine.structured.grammar import GrammarCompiler

    broken = GrammarCompiler(object(), vocab_size=49152)        # no error until it is used
    with pytest.raises(ParamError, match="not available for this model's tokenizer") as e:
        broken.compile(JSON, "response_format")
    assert e.value.param == "response_format"
    compiler = GrammarCompiler(tokenizer, vocab_size=49152)
    assert compiler._ll_tokenizer is None
    compiler.compile(JSON)
    assert compiler._ll_tokenizer is not None and compiler.compiles == 1
