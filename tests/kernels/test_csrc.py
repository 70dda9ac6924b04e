"""The CPU kernels' C++ sources (kernels/csrc): what the build compiles, what keys its folder, and
what a non-editable install ships. None of this needs a compiler."""

from __future__ import annotations

import fnmatch
import os
import shutil

import tomllib

from kernels import cpu_kernels
from tests.conftest import ROOT


def test_the_build_compiles_the_files_in_csrc():
    files = {os.path.basename(p) for p in cpu_kernels.source_files()}
    assert set(cpu_kernels.SOURCES) <= files and "common.h" in files
    # Every .cpp is compiled (a file left out would leave its operators undefined), each included
    # from the build folder's copy into the one unit the build compiles.
    assert {f for f in files if f.endswith(".cpp")} == set(cpu_kernels.SOURCES)
    unity = cpu_kernels.unity_text()
    for name in cpu_kernels.SOURCES:
        assert f'#include "{cpu_kernels.STAGED}/{name}"' in unity
    assert not hasattr(cpu_kernels, "_SOURCE")  # no C++ kept in a Python string


def test_the_build_key_changes_with_any_source_file(tmp_path, monkeypatch):
    csrc = tmp_path / "csrc"
    shutil.copytree(cpu_kernels.CSRC, csrc)
    here = cpu_kernels.build_digest(str(csrc))
    # Another checkout (or a job's working directory) with the same sources shares the build.
    assert here == cpu_kernels.build_digest()
    for name in ("attention.cpp", "common.h"):
        path = csrc / name
        text = path.read_text()
        path.write_text(text + "\n// an edit\n")
        assert cpu_kernels.build_digest(str(csrc)) != here, name
        path.write_text(text)
    assert cpu_kernels.build_digest(str(csrc)) == here
    (csrc / "extra.h").write_text("#pragma once\n")  # a new header counts too
    assert cpu_kernels.build_digest(str(csrc)) != here
    (csrc / "extra.h").unlink()
    monkeypatch.setattr(cpu_kernels, "cpu_signature", lambda: "x86_64 other-cpu sse2")
    assert cpu_kernels.build_digest(str(csrc)) != here  # the CPU stays in the key


def test_the_build_folder_holds_the_sources_it_compiles(tmp_path):
    """The unity file includes copies staged in the build folder; staging again writes nothing
    (an unchanged file keeps its time, so ninja does not rebuild), a changed source is copied."""
    unity = cpu_kernels._unity_source(str(tmp_path))
    staged = tmp_path / cpu_kernels.STAGED
    for src in cpu_kernels.source_files():
        assert (staged / os.path.basename(src)).read_bytes() == open(src, "rb").read()
    times = {p.name: p.stat().st_mtime_ns for p in staged.iterdir()} | {"unity": os.stat(unity).st_mtime_ns}
    cpu_kernels._unity_source(str(tmp_path))
    assert times == {p.name: p.stat().st_mtime_ns for p in staged.iterdir()} | {"unity": os.stat(unity).st_mtime_ns}
    (staged / "common.h").write_text("stale")
    cpu_kernels._unity_source(str(tmp_path))
    assert (staged / "common.h").read_bytes() == open(os.path.join(cpu_kernels.CSRC, "common.h"), "rb").read()


def test_the_sources_are_package_data():
    """A non-editable install ships every C++ file next to cpu_kernels.py."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["kernels"]
    for path in cpu_kernels.source_files():
        rel = os.path.relpath(path, os.path.dirname(cpu_kernels.__file__))
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), rel
