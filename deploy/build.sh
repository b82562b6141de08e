#!/usr/bin/env bash
# Installs what grpo-serve needs (deploy/setup.sh), then configures and builds a Release build
# in ./build with ccache. Usage: deploy/build.sh [extra cmake targets...]
set -euo pipefail
cd "$(dirname "$0")/.."

bash deploy/setup.sh

# ccache's cache lives outside the clone (default ~/.cache/ccache) so that a fresh clone (CI)
# rebuilds from it; CMakeLists.txt makes its entries independent of the clone's path.
ccache --max-size=8G >/dev/null

jobs="${GRPO_BUILD_JOBS:-$(nproc)}"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$jobs" ${1:+--target "$@"}
