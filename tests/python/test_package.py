"""The package as installed: built from this tree, its stubs generated from this tree's proto/
(and never committed), typed, importable, with its command."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpo_serve
from conftest import SOURCE_DIR

PROTOS = ["grpo/v1/learner.proto", "grpo/v1/reward.proto", "grpo/v1/environment.proto"]


def tree_digest() -> str:
    """The digest of this tree's sources, by the tree's own _source.py."""
    spec = importlib.util.spec_from_file_location(
        "tree_source", SOURCE_DIR / "python" / "grpo_serve" / "_source.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.source_digest(SOURCE_DIR))


def test_the_venv_has_the_package_of_this_tree() -> None:
    from grpo_serve import _build_info

    assert _build_info.SOURCE_DIGEST == tree_digest(), (
        f"{grpo_serve.__file__} was built from other sources than {SOURCE_DIR}: run "
        "deploy/setup.sh (it reinstalls python/ when its sources changed)")


def test_no_generated_stub_is_in_the_sources() -> None:
    sources = SOURCE_DIR / "python" / "grpo_serve"
    generated = [p for p in sources.rglob("*") if "_pb2" in p.name or p.name == "_build_info.py"]
    assert generated == []
    assert not (sources / "_proto").exists()


def clear_json_names(messages: Any) -> None:
    for m in messages:
        for f in m.field:
            f.ClearField("json_name")
        clear_json_names(m.nested_type)


def test_the_stubs_are_generated_from_this_trees_proto(tmp_path: Path) -> None:
    # Debian's protoc, not the one the build used, describes the tree's files; the installed
    # modules must describe the same messages, fields and services.
    from google.protobuf import descriptor_pb2

    from grpo_serve._wire import environment_pb2, learner_pb2, reward_pb2

    out = tmp_path / "set.pb"
    subprocess.run(["protoc", f"-I{SOURCE_DIR / 'proto'}", f"--descriptor_set_out={out}",
                    *PROTOS], check=True, timeout=60)
    want = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    for module, expected in zip((learner_pb2, reward_pb2, environment_pb2), want.file, strict=True):
        got = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(got)
        for fdp in (got, expected):
            clear_json_names(fdp.message_type)  # protoc writes them into sets, not into modules
        assert got == expected, expected.name


def test_it_is_typed_and_its_annotations_check() -> None:
    package = Path(grpo_serve.__file__).parent
    assert (package / "py.typed").is_file()
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", "--config-file",
                        str(SOURCE_DIR / "python" / "pyproject.toml"), "-p", "grpo_serve"],
                       capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_source_tree_alone_says_it_must_be_built(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(SOURCE_DIR / "python"))
    r = subprocess.run([sys.executable, "-c", "import grpo_serve"], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=60)
    assert r.returncode != 0 and "generated from proto/" in r.stderr


def test_the_command_is_installed() -> None:
    script = Path(sys.executable).parent / "grpo-serve"
    r = subprocess.run([str(script), "watch", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--report_to" in r.stdout
    r = subprocess.run([str(script), "watch", "--report_to", "neptune",
                        "--learner_address", "127.0.0.1:1"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "unknown report_to 'neptune'" in r.stderr
