"""The CPU kernels compile, link and bind for every x86 host class the project serves, on any
x86 host with a C compiler and binutils' `nm` (engine/kernels).

The kernels take different code under `__AMX_TILE__`, `__AVX512BF16__`, `__AVX512VNNI__` and
`__AVX512F__`, and `tests/conftest.py`'s `lib` builds only what this host can run: an AVX2-only
host never compiles the AVX-512 or AMX branches. Here each class's build is compiled with the
`-march` its hosts get (`isa.march_flags`: `native` there, which these targets stand for) and
linked with `-z defs` (a symbol no library defines fails the link), and its dynamic symbol table
must export every entry point `engine.kernels.CpuKernels` binds. The library is not loaded: its
constructor (quant.c's half-precision table) is compiled for the target and would run, and this
host may not have the instructions. Implicit function declarations are errors here, so an
intrinsic that a target lacks fails the compile instead of leaving an undefined symbol.

Extended tier (CI's `make test-stress`): four builds of ~30 s each on two cores.
"""

import platform
import shutil
import subprocess

import pytest

from engine import kernels
from engine.kernels.isa import _NO_AMX

pytestmark = [pytest.mark.extended,
              pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 host classes")]

# host class -> its build's -march flags
CROSS_BUILDS = {
    "amx (Sapphire / Emerald / Granite Rapids)": ["-march=sapphirerapids"],
    "avx512 + bf16 + vnni (an AMX host capped at avx512 or with AMX hidden; Zen 4 / 5)":
        ["-march=sapphirerapids", *_NO_AMX],
    "avx512 + vnni (Ice Lake, or AVX512-BF16 hidden)": ["-march=icelake-server"],
    "avx512 (Skylake / Cascade Lake baseline)": ["-march=x86-64-v4"],
}


@pytest.mark.parametrize("host_class", list(CROSS_BUILDS))
def test_kernels_build_and_bind_for_every_host_class(host_class, tmp_path):
    compiler, nm = kernels.find_compiler(), shutil.which("nm")
    if compiler is None or nm is None:
        pytest.skip("needs a C compiler and binutils' nm")
    flags = kernels.BASE_CFLAGS + CROSS_BUILDS[host_class] + [
        "-Werror=implicit-function-declaration", "-Wl,-z,defs"]
    try:
        path = kernels.build(compiler, flags, tmp_path)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"{host_class}: the build failed:\n{e.stderr[-3000:]}")
    exported = set(subprocess.run([nm, "-D", "--defined-only", "--format=posix", str(path)],
                                  capture_output=True, text=True, check=True).stdout.split())
    names = [f"{name}_{sfx}" for name in kernels._SIGNATURES for sfx in kernels._SUFFIX.values()]
    names += list(kernels._PLAIN)
    missing = [name for name in names if name not in exported]
    assert not missing, f"{host_class}: entry points missing from the build: {missing}"
