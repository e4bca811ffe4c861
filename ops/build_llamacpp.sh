#!/usr/bin/env bash
# Build llama.cpp's llama-server and llama-perplexity (one CPU build) from the sources vendored in
# the llama-cpp-python sdist, for `nightshift bench llamacpp` and perplexity comparisons.
#
#   ops/build_llamacpp.sh [DEST]      # default DEST=/tmp/llamacpp; binaries land in DEST/bin
#
# Environment: PYTHON (default .venv/bin/python, else python3) provides pip; LLAMA_CPP_PYTHON_VERSION
# pins the sdist (default: the newest on PyPI); JOBS (default: the core count) for the compile.
# The build uses this CPU's vector extensions (below): its binaries may not run on another CPU model. It takes
# about 11 minutes on 2 cores. Nothing is written inside the repository: the sdist, the sources
# and the build tree live under DEST/src and DEST/build, and the script refuses a DEST in the repo.
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-/tmp/llamacpp}"
mkdir -p "$dest"
dest="$(cd "$dest" && pwd)"
case "$dest/" in
"$repo"/*)
    echo "build_llamacpp.sh: DEST $dest is inside the repository; give a directory outside it" >&2
    exit 2
    ;;
esac

python="${PYTHON:-}"
if [ -z "$python" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then python="$repo/.venv/bin/python"; else python=python3; fi
fi
spec="llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}"
jobs="${JOBS:-$(nproc)}"

# The sdist, not a wheel: a wheel holds only the shared library, not the server's sources.
mkdir -p "$dest/src"
"$python" -m pip download --no-deps --no-binary :all: "$spec" -d "$dest/src"
sdist="$(ls -t "$dest"/src/llama_cpp_python-*.tar.gz | head -n 1)"
tar -xzf "$sdist" -C "$dest/src"
source_dir="${sdist%.tar.gz}/vendor/llama.cpp"
[ -f "$source_dir/CMakeLists.txt" ] || { echo "no vendored llama.cpp in $sdist" >&2; exit 1; }

# The CPU's own vector extensions, named one by one rather than -march=native: native also turns
# on AMX where the CPU lists it, and ggml's AMX matmul dies of SIGILL at its first tile
# instruction on virtual machines whose hypervisor does not hand the tile state over (seen on a
# Xeon VM listing amx_tile, 2026-12-05). Our kernels use no AMX either, so both sides run the
# same AVX512/AVX2 integer dot products. LLAMA_AMX=1 keeps the native build, AMX included.
flags=" $(grep -m 1 '^flags' /proc/cpuinfo 2>/dev/null || true) "
isa=()
if [ "${LLAMA_AMX:-0}" = 1 ]; then
    isa+=(-DGGML_NATIVE=ON)
else
    isa+=(-DGGML_NATIVE=OFF)
    for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx_vnni:AVX_VNNI avx512f:AVX512 \
        avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16; do
        case "$flags" in
        *" ${pair%%:*} "*) isa+=("-DGGML_${pair#*:}=ON") ;;
        *) isa+=("-DGGML_${pair#*:}=OFF") ;;
        esac
    done
fi

# LLAMA_CURL=OFF: the server loads a local GGUF only; no libcurl needed (newer trees ignore it).
cmake -S "$source_dir" -B "$dest/build" \
    -DCMAKE_BUILD_TYPE=Release \
    "${isa[@]}" \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_CURL=OFF \
    -DBUILD_SHARED_LIBS=OFF
cmake --build "$dest/build" --target llama-server llama-perplexity -j "$jobs"

mkdir -p "$dest/bin"
cp "$dest/build/bin/llama-server" "$dest/build/bin/llama-perplexity" "$dest/bin/"
echo "built $(basename "$sdist" .tar.gz): $dest/bin/llama-server $dest/bin/llama-perplexity"
