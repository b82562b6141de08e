#!/usr/bin/env bash
# Installs every Debian package grpo-serve needs. Idempotent: a second run installs nothing.
# Usage (as root on Debian 12): deploy/setup.sh
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev libopenblas0-pthread libgloo-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libboost-dev libboost-system-dev
  nlohmann-json3-dev libspdlog-dev libfmt-dev libcli11-dev libyaml-cpp-dev
  libsqlite3-dev libpcre2-dev libicu-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  python3-torch python3-numpy python3-grpcio python3-protobuf
  openssl
  prometheus docker-compose
)
# node + npm derive the tokenizer test's expected ids; use the machine's node if one is there.
if ! command -v npm >/dev/null 2>&1; then
  PACKAGES+=(nodejs npm)
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${#missing[@]} packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all ${#PACKAGES[@]} packages already installed"
fi

# libtorch must use OpenBLAS, not the reference BLAS (15x slower matmul).
if update-alternatives --list libblas.so.3-x86_64-linux-gnu >/dev/null 2>&1; then
  blas=$(update-alternatives --list libblas.so.3-x86_64-linux-gnu | grep openblas-pthread | head -n1 || true)
  if [ -n "$blas" ]; then
    update-alternatives --set libblas.so.3-x86_64-linux-gnu "$blas" >/dev/null
  fi
  lapack=$(update-alternatives --list liblapack.so.3-x86_64-linux-gnu 2>/dev/null | grep openblas-pthread | head -n1 || true)
  if [ -n "$lapack" ]; then
    update-alternatives --set liblapack.so.3-x86_64-linux-gnu "$lapack" >/dev/null
  fi
fi
