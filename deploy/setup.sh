#!/usr/bin/env bash
# Installs everything grpo-serve needs. Idempotent: a second run installs nothing.
#   1. Debian packages: compilers, gRPC, Gloo's headers, SQLite, prometheus-cpp, the test and
#      deploy tools.
#   2. A virtual environment the project owns, outside the clone so that clones and CI share it
#      ($GRPO_VENV, default /opt/grpo-serve/venv), with PyTorch's own libtorch (the `torch`
#      wheel, pinned below; its CUDA build, which links and runs on machines without a GPU) and
#      the references the tests check against: transformers, tokenizers, trl, grpcio.
#   3. The Python package `grpo-serve` (python/) into that environment, built from this clone
#      (again only when its sources changed since the last install).
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
  # The Python package (python/): its stubs are generated from proto/ at build time; its tests
  # (tests/python, pytest) log to the real dashboards and run TRL's own reward functions.
  "grpcio-tools==1.85.1" "pytest==9.2.0"
  "tensorboard==2.21.0" "trackio==0.43.0" "wandb==0.31.0"
  # mlflow-skinny: the tracking client with its local file store; the full `mlflow` pins
  # pyarrow<26 and would downgrade the pyarrow that `datasets` uses.
  "mlflow-skinny==3.17.2"
  "math-verify==0.9.0"  # trl.rewards.accuracy_reward needs it
  "mypy==2.4.1"  # the package's type annotations, checked by its tests
  # OpenEnv's server (create_app) for openenv_environment_test's reference server; adds ~44
  # packages (fastapi-adjacent, gradio, fastmcp, openai) and changes none of the pins above.
  "openenv-core==0.3.0"
)
# Bounds given to every pip install with the pins (pip freeze does not list setuptools, so it
# cannot be a pin above): torch 2.11.0 requires setuptools<82, grpcio-tools >=77.
PY_CONSTRAINTS=("setuptools<82")
VENV="${GRPO_VENV:-/opt/grpo-serve/venv}"

PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libgloo-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libboost-dev libboost-system-dev
  prometheus-cpp-dev  # common/metrics: the registry, families and text exposition
  nlohmann-json3-dev libspdlog-dev libfmt-dev libcli11-dev libyaml-cpp-dev
  libsqlite3-dev libpcre2-dev libicu-dev
  libtcmalloc-minimal4  # the grpo binary's malloc (CMakeLists.txt GRPO_MALLOC)
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
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${need[@]}" \
    "${PY_CONSTRAINTS[@]}"
  echo "setup: Python packages took $(( $(date +%s) - t1 )) s"
else
  echo "setup: $VENV has torch ${TORCH_VERSION} and the references"
fi

# The Python package, built from this clone (non-editable: the venv is shared by every clone, so
# it must not point into one). Reinstalled only when its sources (python/, proto/) differ from
# what the installed copy was built from (grpo_serve/_source.py: one digest for both sides).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -f "$ROOT/python/pyproject.toml" ]; then
  t2=$(date +%s)
  want=$("$VENV/bin/python" "$ROOT/python/grpo_serve/_source.py" "$ROOT")
  have_pkg=$("$VENV/bin/python" -I -c \
    'import grpo_serve._build_info as b; print(b.SOURCE_DIGEST)' 2>/dev/null || true)
  if [ "$want" != "$have_pkg" ]; then
    echo "setup: pip installing the grpo-serve Python package from $ROOT/python"
    rm -rf "$ROOT/python/build"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation \
      "$ROOT/python"
    echo "setup: the Python package took $(( $(date +%s) - t2 )) s"
  else
    echo "setup: $VENV has the grpo-serve Python package of these sources"
  fi
else
  # The Docker image's first layer copies this script alone; the package comes with the sources.
  echo "setup: no python/ beside deploy/: the grpo-serve Python package is not installed"
fi
