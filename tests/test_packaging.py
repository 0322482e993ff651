"""The wheel: the bundled envs and tools install as agentrl.envs / agentrl.tools, never as top-level packages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_package_list_names_every_package_folder():
    """pyproject lists packages by hand (the envs/tools mapping needs it): a new subpackage must be added there."""
    conf = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = conf["package-dir"]
    assert dirs == {"agentrl.envs": "envs", "agentrl.tools": "tools"}
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "agentrl").rglob("__init__.py")}
    found |= {name for name, folder in dirs.items() if (REPO / folder / "__init__.py").is_file()}
    assert set(conf["packages"]) == found


def test_the_wheel_installs_envs_and_tools_inside_agentrl(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("agentrl", "envs", "tools"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path)]
    subprocess.run([*build, str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("agentrl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"agentrl", wheel.name.removesuffix("-py3-none-any.whl") + ".dist-info"}
    assert "agentrl/envs/data/gsm8k/LICENSE" in names and "agentrl/tools/python.py" in names
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    code = (
        "import importlib.util, agentrl, agentrl.envs.gsm8k as g, agentrl.tools as t\n"
        f"print(agentrl.__file__.startswith({str(site)!r}), g.DATA.is_dir(), t.calculator.name)\n"
        "print(importlib.util.find_spec('envs') is None, importlib.util.find_spec('tools') is None)\n"
        "print(agentrl.load_env('agentrl/GSM8K-v0') is g.GSM8K, agentrl.load_env('envs.gsm8k:GSM8K') is g.GSM8K)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["True", "True", "calculator", "True", "True", "True", "True"]
