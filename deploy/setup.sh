#!/usr/bin/env bash
# Installs everything grpo-serve needs. Idempotent: a second run installs nothing.
#   1. Debian packages: compilers, gRPC, Gloo's headers, SQLite, prometheus-cpp, the test and
#      deploy tools.
#   2. A virtual environment the project owns, outside the clone so that clones and CI share it
#      ($GRPO_VENV, default /opt/grpo-serve/venv), with PyTorch's own libtorch (the `torch`
#      wheel, pinned below; its CUDA build, which links and runs on machines without a GPU) and
#      the references the tests check against: transformers, tokenizers, trl, grpcio.
# Usage (as root on Debian 12): deploy/setup.sh
set -euo pipefail

# The one libtorch: the version on the project's GPU machines (torch 2.11.0 with CUDA 13.0).
TORCH_VERSION=2.11.0
# References, pinned so that an upstream release cannot change what the tests compare with.
PY_PACKAGES=(
  "torch==${TORCH_VERSION}"
  "transformers==5.24.0"
  "tokenizers==0.23.3"
  "trl==1.16.0"
  "grpcio" "protobuf"
)
VENV="${GRPO_VENV:-/opt/grpo-serve/venv}"

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libgloo-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libboost-dev libboost-system-dev
  prometheus-cpp-dev  # common/metrics: the registry, families and text exposition
  nlohmann-json3-dev libspdlog-dev libfmt-dev libcli11-dev libyaml-cpp-dev
  libsqlite3-dev libpcre2-dev libicu-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  clang-14  # thread_safety_test: clang -Wthread-safety checks the lock annotations
  python3 python3-venv
  openssl
  clang-format-14
  prometheus docker-compose
)

t0=$(date +%s)
missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${#missing[@]} Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
  echo "setup: Debian packages took $(( $(date +%s) - t0 )) s"
else
  echo "setup: all ${#PACKAGES[@]} Debian packages already installed"
fi

# The virtual environment, made with Debian's Python (not whatever python3 is first on PATH),
# so that every machine gets the same interpreter.
t1=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  mkdir -p "$(dirname "$VENV")"
  /usr/bin/python3 -m venv "$VENV"
fi
# `pip freeze` names what is there; install only when a pin is missing or differs.
have=$("$VENV/bin/python" -m pip freeze 2>/dev/null | tr 'A-Z_' 'a-z-')
need=()
for spec in "${PY_PACKAGES[@]}"; do
  name=${spec%%==*}
  name=$(echo "$name" | tr 'A-Z_' 'a-z-')
  if [[ "$spec" == *"=="* ]]; then
    grep -qx "$(echo "$spec" | tr 'A-Z_' 'a-z-')" <<<"$have" || need+=("$spec")
  else
    grep -q "^${name}==" <<<"$have" || need+=("$spec")
  fi
done
if [ "${#need[@]}" -gt 0 ]; then
  echo "setup: pip installing into $VENV: ${need[*]} (torch's CUDA build is ~3 GB, once)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${need[@]}"
  echo "setup: Python packages took $(( $(date +%s) - t1 )) s"
else
  echo "setup: $VENV has torch ${TORCH_VERSION} and the references"
fi
