#!/usr/bin/env bash
# llama.cpp's `llama-server` for this host, as ../shared/REFERENCES.md builds it: the llama.cpp
# tree vendored in the llama-cpp-python sdist (PyPI), CMake with GGML_NATIVE off and the vector
# extensions this CPU has switched on one by one (AVX2 + FMA + F16C always; AVX-512 F/BW/VL,
# VBMI, VNNI and BF16 where /proc/cpuinfo lists them). The AMX flags stay off on every host: the
# AMX build dies with SIGILL in `tilezero` on these machines (the kernel grants no tile state
# unless asked), which benchmarks/cpu_peers_bench.py's figures say beside llama-server's.
#
# In: DEST (default build/peers), LLAMA_CPP_PYTHON (an sdist version; default the newest).
# Out: DEST/llama-server (a link to the binary), DEST/llama-server.flags (the CMake flags used).
# Two cores: ~15 min. Re-running with the binary present does nothing.
set -euo pipefail
DEST=${1:-build/peers}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
if [ -x "$DEST/llama-server" ]; then
  echo "llama-server: $DEST/llama-server is built ($(cat "$DEST/llama-server.flags"))"
  exit 0
fi
has() { grep -qw "$1" /proc/cpuinfo; }
flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
       -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF)
if has avx512f && has avx512bw && has avx512vl; then
  flags+=(-DGGML_AVX512=ON)
  has avx512vbmi && flags+=(-DGGML_AVX512_VBMI=ON)
  has avx512_vnni && flags+=(-DGGML_AVX512_VNNI=ON)
  has avx512_bf16 && flags+=(-DGGML_AVX512_BF16=ON)
fi
src="$DEST/src"
rm -rf "$src" && mkdir -p "$src"
python3 -m pip download -q --no-deps --no-binary :all: -d "$src" \
  "llama-cpp-python${LLAMA_CPP_PYTHON:+==$LLAMA_CPP_PYTHON}"
tar -xzf "$src"/llama_cpp_python-*.tar.gz -C "$src"
tree=$(echo "$src"/llama_cpp_python-*/vendor/llama.cpp)
echo "llama-server: building $tree with ${flags[*]}"
cmake -S "$tree" -B "$tree/build" -DCMAKE_BUILD_TYPE=Release "${flags[@]}" > "$DEST/cmake.log"
cmake --build "$tree/build" -j "$(nproc)" --target llama-server >> "$DEST/cmake.log"
ln -sf "$tree/build/bin/llama-server" "$DEST/llama-server"
echo "${flags[*]}" > "$DEST/llama-server.flags"
echo "llama-server: $DEST/llama-server"
