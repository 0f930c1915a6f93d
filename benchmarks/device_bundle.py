"""The GPU check's bundle (`benchmarks/device_check.py`): what it needs on a machine with no
network and no `gguf`; its other measurements are `benchmarks/device_measure.py`.

The bundle, prepared here (a machine with both) into `build/device/` (gitignored; the device
run carries it with the work tree). In: the embedded model (`engine.loader.resolve_model(None)`,
which converts the GGUF and so needs `gguf`) and PyPI (through pip). Out:

    build/device/base/       config.json + tokenizer files of the embedded model: the base of
                             every random-weight checkpoint (`benchmarks.checkpoints`)
    build/device/wheels/     wheels of the modules the check imports that the GPU image lacks
    build/device/MANIFEST.json   files, sizes and the pip command that fetched each wheel

The GPU image has torch, transformers, triton, grpcio, prometheus-client and numpy, and not
fastapi, uvicorn, sse-starlette, gguf or llguidance. Of those, the check's import path
(`engine.llm_engine`) needs only llguidance, at top level: `engine.sampler` imports
`engine.structured.mask`, and `LLMEngine` builds a `GrammarCompiler` (llguidance's tokenizer)
at start. llguidance ships one abi3 wheel per platform (`cp39-abi3`), so the wheel fetched here
installs on any Python >= 3.9 there, whichever version the image has.

    python benchmarks/device_bundle.py [--out build/device]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

ROOT = Path(__file__).resolve().parent.parent
# (distribution, pip platform tag): pure-python or abi3 wheels only (see the module docstring)
WHEELS = (("llguidance", "manylinux_2_31_x86_64"),)
BASE_FILES = ("config.json", "chat_template.jinja")
MAX_BYTES = 16 << 20          # far below the 64 MiB a device run carries


def copy_base(out: Path) -> list[str]:
    """config.json and the tokenizer files of the embedded model into `out`."""
    from benchmarks.checkpoints import TOKENIZER_FILES
    from engine.loader import resolve_model

    src = resolve_model(None)
    out.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in BASE_FILES + TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
            copied.append(name)
    return copied


def pip_command(dist: str, tag: str, dest: Path) -> list[str]:
    """The pip download of `dist` at the version installed here, as a binary for `tag`."""
    version = importlib.metadata.version(dist)
    return [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps",
            "--python-version", "3.12", "--implementation", "cp", "--platform", tag,
            "-d", str(dest), f"{dist}=={version}"]


def fetch_wheels(out: Path) -> list[dict]:
    """Each of `WHEELS` into `out` (skipped when a wheel of that version is there already).
    Raises RuntimeError when pip fails or brings a wheel that is not abi3 or pure Python."""
    out.mkdir(parents=True, exist_ok=True)
    fetched = []
    for dist, tag in WHEELS:
        cmd = pip_command(dist, tag, out)
        version = cmd[-1].split("==")[1]
        have = sorted(out.glob(f"{dist}-{version}-*.whl"))
        if not have:
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"pip download {dist} failed: {done.stderr.strip()[-500:]}")
            have = sorted(out.glob(f"{dist}-{version}-*.whl"))
        for whl in have:
            if not ("-abi3-" in whl.name or whl.name.endswith("-none-any.whl")):
                raise RuntimeError(f"{whl.name}: not an abi3 or pure-python wheel")
        fetched.append({"wheel": have[0].name,
                        "command": " ".join(["pip"] + cmd[3:]).replace(f"{ROOT}/", "")})
    return fetched


def build_bundle(out: Path) -> dict:
    """Prepare `out` (see the module docstring) and return its manifest. Raises RuntimeError
    when the bundle would exceed `MAX_BYTES`."""
    base = copy_base(out / "base")
    wheels = fetch_wheels(out / "wheels")
    files = {str(p.relative_to(out)): p.stat().st_size
             for p in sorted(out.rglob("*")) if p.is_file() and p.name != "MANIFEST.json"}
    total = sum(files.values())
    if total > MAX_BYTES:
        raise RuntimeError(f"bundle is {total / 2**20:.1f} MiB, over {MAX_BYTES >> 20} MiB")
    manifest = {"base_files": base, "wheels": wheels, "files": files, "total_bytes": total}
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "build" / "device"))
    args = ap.parse_args(argv)
    manifest = build_bundle(Path(args.out))
    print(json.dumps({"out": args.out, "total_mib": round(manifest["total_bytes"] / 2**20, 2),
                      "wheels": [w["wheel"] for w in manifest["wheels"]]}))
    return manifest


if __name__ == "__main__":
    main()
