"""LoRA through a real server, as users reach it: `continuum serve --enable-lora --lora-modules
...` with two peft adapters (tests/test_lora.py's, made here), runtime updates on
(`VLLM_ALLOW_RUNTIME_LORA_UPDATING`). The OpenAI SDK naming an adapter gets transformers +
peft's greedy tokens, alone and four adapters and the base at once; chat streams the same text
it answers whole; Triton's generate takes the vLLM backend's `lora_name` parameter (gRPC its
`sampling_parameters`); adapters load and unload while requests run; metrics count per
adapter; every bad case is a 4xx and the server stays live. (Side by side with vLLM itself:
tests/test_vllm_lora_differential.py.)"""

from __future__ import annotations

import os
import queue
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import tritonclient.grpc as grpcclient

from tests.conftest import MODEL, free_port, metric, start_server, stop_server
from tests.test_lora import SPECS, hf_greedy, make_adapter
from tests.test_triton_llm import llm_inputs

pytestmark = [pytest.mark.slow, pytest.mark.extended]   # a server of its own: CI's stress tier
peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[test]')")
NAMES = ["attn8", "all16"]                       # served from the start; mlp4 loaded later
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapters(model_dir, tokenizer, tmp_path_factory):
    """{name: (path, greedy text after PROMPT)} for the three adapters used here, and None."""
    import torch
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("adapters")
    prompt = tokenizer.encode(PROMPT)
    out = {}
    for name in NAMES + ["mlp4"]:
        ids = hf_greedy(make_adapter(model_dir, root / name, *SPECS[name]), prompt)
        out[name] = (str(root / name), tokenizer.decode(ids))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out[None] = (None, tokenizer.decode(hf_greedy(base, prompt)))
    return out


GRPC: list[str] = []


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory):
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    GRPC.append(f"127.0.0.1:{free_port()}")
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
    try:
        proc, base = start_server(
            ["--quantization", "none", "--dtype", "float32", "--max-model-len", "512",
             "--kv-cache-memory", "0.1", "--enable-lora", "--max-loras", "2",
             "--max-cpu-loras", "2", "--grpc-port", GRPC[-1].rsplit(":", 1)[1],
             "--lora-modules", *[f"{n}={adapters[n][0]}" for n in NAMES]],
            "/health/ready", log)
    finally:
        del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    yield base
    stop_server(proc)
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def complete(client, model, max_tokens=16) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                     temperature=0).choices[0].text


def alive(client) -> None:
    assert complete(client, "attn8", 2)


def test_models_list_the_adapters_under_the_base(client, adapters):
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    for name in NAMES:
        assert cards[name]["parent"] == MODEL and cards[name]["root"] == adapters[name][0]


def test_each_adapter_and_a_mixed_batch_give_peft_greedy(client, adapters):
    """Alone, then 8 concurrent requests over two adapters and the base (two slots): each
    is transformers + peft's greedy text; the response names the adapter."""
    for name in NAMES:
        r = client.completions.create(model=name, prompt=PROMPT, max_tokens=16, temperature=0)
        assert r.model == name and r.choices[0].text == adapters[name][1]
    models = [NAMES[0], MODEL, NAMES[1], NAMES[0], MODEL, NAMES[1], NAMES[1], NAMES[0]]
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda m: complete(client, m), models))
    assert texts == [adapters[None if m == MODEL else m][1] for m in models]


def test_chat_streams_what_it_answers_whole(client):
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    whole = client.chat.completions.create(model="all16", messages=messages, max_tokens=12,
                                           temperature=0).choices[0].message.content
    chunks = client.chat.completions.create(model="all16", messages=messages, max_tokens=12,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_triton_generate_takes_lora_name(server, client, adapters):
    """The vLLM backend's `lora_name` request parameter (HTTP generate) and sampling_parameters
    key (gRPC stream); an unknown one is refused with its words."""
    r = httpx.post(f"{server}/v2/models/{MODEL}/generate", timeout=120, json={
        "text_input": PROMPT, "parameters": {"max_tokens": 16, "temperature": 0,
                                             "lora_name": "attn8",
                                             "exclude_input_in_output": True}})
    assert r.status_code == 200 and r.json()["text_output"] == adapters["attn8"][1]
    r = httpx.post(f"{server}/v2/models/{MODEL}/generate", timeout=120, json={
        "text_input": PROMPT, "parameters": {"lora_name": "nope"}})
    assert r.status_code == 400
    assert r.json()["error"] == ("LoRA nope is not supported, we currently support "
                                 "['attn8', 'all16']")
    c = grpcclient.InferenceServerClient(GRPC[-1])
    try:
        got: queue.Queue = queue.Queue()
        c.start_stream(callback=lambda result, error: got.put((result, error)))
        c.async_stream_infer(MODEL, llm_inputs(PROMPT, True, {
            "temperature": 0, "max_tokens": 16, "lora_name": "all16"}), request_id="s")
        pieces, final = [], False
        while not final:
            result, error = got.get(timeout=120)
            assert error is None, error
            pieces.append(result.as_numpy("text_output")[0].decode())
            final = result.get_response().parameters["triton_final_response"].bool_param
        c.stop_stream()
    finally:
        c.close()
    assert "".join(pieces) == adapters["all16"][1]
    alive(client)


def test_load_and_unload_while_requests_run(server, client, adapters):
    """A request of an adapter streams to its end while that adapter is unloaded; then the
    adapter is a 404, loads again and serves again; a third adapter loads at run time."""
    def post(path, body):
        return httpx.post(server + path, json=body, timeout=120)

    stream = client.completions.create(model="attn8", prompt=PROMPT, max_tokens=40,
                                       temperature=0, stream=True, extra_body={
                                           "ignore_eos": True})
    first = next(iter(stream))
    assert post("/v1/unload_lora_adapter", {"lora_name": "attn8"}).status_code == 200
    rest = [c.choices[0] for c in stream if c.choices]
    assert rest[-1].finish_reason == "length"
    assert (first.choices[0].text + "".join(c.text for c in rest)).startswith(
        adapters["attn8"][1])
    with pytest.raises(openai.NotFoundError):
        complete(client, "attn8")
    r = post("/v1/load_lora_adapter", {"lora_name": "attn8", "lora_path": adapters["attn8"][0]})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'attn8' added successfully."
    r = post("/v1/load_lora_adapter", {"lora_name": "mlp4", "lora_path": adapters["mlp4"][0]})
    assert r.status_code == 200
    assert complete(client, "mlp4") == adapters["mlp4"][1]
    assert complete(client, "attn8") == adapters["attn8"][1]
    assert post("/v1/unload_lora_adapter", {"lora_name": "mlp4"}).status_code == 200


@pytest.mark.parametrize("body,status,words", [
    ({"lora_name": "x", "lora_path": "/nonexistent"}, 400, "does not exist"),
    ({"lora_name": "attn8", "lora_path": "/nonexistent"}, 400, "already been loaded"),
    ({"lora_name": MODEL, "lora_path": "/nonexistent"}, 400, "conflicts with a served base"),
    ({"lora_name": "x"}, 400, "lora_path"),
])
def test_bad_loads_are_400(server, client, body, status, words):
    r = httpx.post(server + "/v1/load_lora_adapter", json=body, timeout=60)
    assert r.status_code == status and words in r.text, r.text
    alive(client)


def test_bad_rank_and_unknown_names(server, client, model_dir, tmp_path):
    """An adapter above --max-lora-rank is refused naming it; unknown adapters are 404s."""
    big = tmp_path / "big"
    make_adapter(model_dir, big, 5, 32, ["q_proj"], False)
    r = httpx.post(server + "/v1/load_lora_adapter",
                   json={"lora_name": "big", "lora_path": str(big)}, timeout=60)
    assert r.status_code == 400 and "rank 32" in r.text and "'big'" in r.text
    r = httpx.post(server + "/v1/unload_lora_adapter", json={"lora_name": "nope"}, timeout=60)
    assert r.status_code == 404
    with pytest.raises(openai.NotFoundError) as e:
        complete(client, "nope")
    assert e.value.body["message"] == f"The model `nope` does not exist. Valid aliases: {MODEL}."
    alive(client)


def test_metrics_count_per_adapter(server, client):
    before = metric(server, 'continuum_lora_request_success_total{finished_reason="length",'
                            f'lora_name="all16",model_name="{MODEL}"}}')
    complete(client, "all16", 3)
    text = httpx.get(server + "/metrics").text
    after = metric(server, 'continuum_lora_request_success_total{finished_reason="length",'
                           f'lora_name="all16",model_name="{MODEL}"}}')
    assert after == before + 1
    assert f'continuum_lora_adapters_loaded{{model_name="{MODEL}"}}' in text
    assert "continuum_lora_requests_info{" in text and 'max_lora="2"' in text
