"""Model resolution, the conversion cache, and the device layer."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from engine.device import DeviceUnavailableError, resolve_device, resolve_dtype
from engine.loader import (ModelLoadError, UnsupportedArchitectureError, cache_is_valid,
                           convert_gguf, embedded_gguf_path, resolve_model)


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitectureError, match="'GPT2LMHeadModel' is not supported"):
        resolve_model(str(tmp_path))


def test_unknown_model_name_is_not_downloaded():
    with pytest.raises(ModelLoadError, match="never downloads"):
        resolve_model("meta-llama/Llama-3-8B")


def test_embedded_model_resolves_to_a_valid_cache(model_dir):
    assert cache_is_valid(model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in model_dir.iterdir()}
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.extended
def test_corrupt_or_partial_cache_is_detected_and_rebuilt(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CONTINUUM_CACHE", str(tmp_path))
    target = tmp_path / "models" / model_dir.name
    shutil.copytree(model_dir, target)
    assert convert_gguf(embedded_gguf_path()) == target          # valid copy: reused
    (target / "config.json").write_text("{not json")             # corrupt a small file
    assert not cache_is_valid(target)
    with open(target / "model.safetensors", "r+b") as f:         # and truncate the weights
        f.truncate(1000)
    rebuilt = convert_gguf(embedded_gguf_path())
    assert rebuilt == target and cache_is_valid(target)
    assert (target / "model.safetensors").stat().st_size == (model_dir / "model.safetensors").stat().st_size


def test_npu_without_torch_npu_fails_clearly():
    with pytest.raises(DeviceUnavailableError, match="torch_npu"):
        resolve_device("npu")


def test_device_and_dtype_resolution():
    cpu = resolve_device("cpu")
    assert cpu.kind == "cpu"
    assert resolve_dtype("auto", cpu) in (torch.float32, torch.bfloat16)   # per host: test_cpu_isa
    assert resolve_dtype("float32", cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="--dtype"):
        resolve_dtype("int3", cpu)
    with pytest.raises(ValueError, match="--device"):
        resolve_device("tpu")


@pytest.mark.parametrize("arch, cfg", [
    ("MistralForCausalLM", {}), ("MistralForCausalLM", {"sliding_window": None}),
    ("MistralForCausalLM", {"sliding_window": 32}),
    ("Qwen2ForCausalLM", {}), ("Qwen2ForCausalLM", {"use_sliding_window": True}),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 16,
                          "max_window_layers": 2}),
    ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 16,
                          "layer_types": ["sliding_attention", "full_attention"] * 2}),
    ("LlamaForCausalLM", {"sliding_window": 16})])
def test_sliding_windows_are_read_as_transformers_reads_them(arch, cfg):
    """Each layer's window from config.json (engine/models/llama.py) against transformers'
    own config classes: their `sliding_window` and `layer_types`, where the model has them."""
    from transformers import AutoConfig

    from engine.models.llama import _sliding_windows

    base = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4,
                intermediate_size=128, vocab_size=100)
    window, layers = _sliding_windows({**base, **cfg}, arch)
    ref = AutoConfig.for_model({"MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                                "LlamaForCausalLM": "llama"}[arch], **base, **cfg)
    types = getattr(ref, "layer_types", None)
    # LlamaConfig keeps an unknown `sliding_window` as an attribute; Llama never reads it
    ref_window = getattr(ref, "sliding_window", None) if arch != "LlamaForCausalLM" else None
    if types is None:                    # Mistral: every layer; Llama: none
        types = ["sliding_attention" if ref_window else "full_attention"] * 4
    assert layers == tuple(ref_window if t == "sliding_attention" else 0 for t in types)
    assert window == (ref_window if any(layers) else None)


def test_a_conversion_shares_one_reader_and_name_map_then_restores_gguf(tmp_path):
    """Within `_gguf_reads_shared` a file gets one `GGUFReader` and an (architecture, layers)
    pair one `TensorNameMap` (transformers' GGUF loader builds them per call and per tensor);
    gguf-py's own names are back afterwards, also when the conversion raises."""
    import gguf

    from engine.loader import _gguf_reads_shared

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="stop"), _gguf_reads_shared():
        first = gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(path) is first and isinstance(first, reader_class)
        assert first.tensors[0].name == "token_embd.weight"
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 3) is not gguf.get_tensor_name_map(arch, 2)
        raise RuntimeError("stop")
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
    assert gguf.GGUFReader(str(path)) is not first


def truncated_gguf(src, dst, layers: int) -> None:
    """Copy the llama GGUF `src` to `dst` with its first `layers` blocks only (metadata kept,
    `llama.block_count` set): a small model with the embedded tokenizer."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), "llama")
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == "llama.block_count" else field.contents()
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.extended          # two conversions of a 2-layer GGUF, one without the sharing: ~25 s
def test_shared_reads_convert_to_the_same_bytes(tmp_path):
    """The conversion with one reader and name map per file writes the same files, byte for
    byte, as transformers' own loader left to build its own."""
    from engine.loader import _write_hf_directory

    src = tmp_path / "two-layers.gguf"
    truncated_gguf(embedded_gguf_path(), src, 2)
    for name, shared in (("shared", True), ("plain", False)):
        (tmp_path / name).mkdir()
        _write_hf_directory(src, tmp_path / name, "LlamaForCausalLM", shared_reads=shared)
    files = sorted(p.name for p in (tmp_path / "shared").iterdir())
    assert "model.safetensors" in files
    assert files == sorted(p.name for p in (tmp_path / "plain").iterdir())
    for name in files:
        assert (tmp_path / "shared" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()


@pytest.mark.parametrize("content", [b"hello\n", None])
def test_an_unreadable_gguf_is_a_load_error_naming_the_file(tmp_path, monkeypatch, content):
    """Not a GGUF, or one cut short inside its metadata: ModelLoadError, nothing cached."""
    monkeypatch.setenv("CONTINUUM_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content or embedded_gguf_path().read_bytes()[:100_000])
    with pytest.raises(ModelLoadError, match="bad.gguf: cannot read GGUF tensors"):
        resolve_model(str(bad))
    assert not list((tmp_path / "cache").rglob("*.safetensors"))


def test_a_failed_conversion_names_the_error_and_leaves_no_directories(tmp_path, monkeypatch):
    """A llama GGUF without tensors: the conversion process's error reaches the caller as a
    ModelLoadError; its temporary directory, and one a killed conversion left, are gone."""
    import gguf

    from engine.loader import _cache_key

    monkeypatch.setenv("CONTINUUM_CACHE", str(tmp_path / "cache"))
    empty = tmp_path / "empty.gguf"
    w = gguf.GGUFWriter(str(empty), "llama")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    models = tmp_path / "cache" / "models"
    abandoned = models / f"{_cache_key(empty)}.tmp-{2**22 + 12345}"    # above pid_max's default
    abandoned.mkdir(parents=True)
    with pytest.raises(ModelLoadError, match=r"converting .*empty.gguf failed: \w+Error: "):
        resolve_model(str(empty))
    assert list(models.iterdir()) == []


@pytest.mark.extended          # a 2-layer GGUF converted in a fresh interpreter: ~15 s
def test_a_conversion_leaves_the_callers_process_as_it_was(tmp_path):
    """The conversion runs in a process of its own: the caller imports neither transformers nor
    torch for it, and exits without warnings (tqdm's semaphore, Triton's nanobind leak report
    were printed at a converting server's exit)."""
    import subprocess
    import sys

    src = tmp_path / "two-layers.gguf"
    truncated_gguf(embedded_gguf_path(), src, 2)
    code = ("import sys; from pathlib import Path; from engine.loader import convert_gguf; "
            f"d = convert_gguf(Path({str(src)!r})); "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules), "
            "(d / 'model.safetensors').exists())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "CONTINUUM_CACHE": str(tmp_path)},
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[] True"
    assert "leaked" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}),                                     # built directly (engine/tokenizer.py)
    ("qwen2", {}),                                     # AutoTokenizer picks Qwen2Tokenizer
    ("llama", {"special_tokens_map.json": {"eos_token": "<|endoftext|>"}}),   # read over
], ids=["llama", "qwen2", "special-tokens-map"])
def test_the_tokenizer_is_the_one_autotokenizer_loads(model_dir, tmp_path, model_type, extra):
    """`engine.tokenizer.load_tokenizer` skips AutoTokenizer's AutoConfig only where that
    choice is TokenizersBackend anyway, and `eos_token_id` (the engine core's only use of
    the tokenizer at start) reads the id AutoTokenizer's tokenizer has, also where a
    special_tokens_map.json overrides tokenizer_config.json."""
    from transformers import AutoTokenizer

    from engine.tokenizer import direct_class, eos_token_id, load_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_dir / name, tmp_path / name)
    config = json.loads((model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
    for name, content in extra.items():
        (tmp_path / name).write_text(json.dumps(content))
    reference = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = load_tokenizer(tmp_path)
    assert direct_class(tmp_path) == (model_type == "llama")
    assert type(ours) is type(reference)
    assert eos_token_id(tmp_path) == ours.eos_token_id == reference.eos_token_id
    assert ours.get_vocab() == reference.get_vocab()
    assert ours.all_special_tokens == reference.all_special_tokens
    chat = [{"role": "user", "content": "Écris « bonjour » 3 fois, s'il te plaît."}]
    ids = reference.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True) == ids
    ids = list(ids if isinstance(ids, list) else ids["input_ids"])
    assert ours.decode(ids, skip_special_tokens=True) == \
        reference.decode(ids, skip_special_tokens=True)
