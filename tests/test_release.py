"""What a lab installs: one version everywhere, a LICENSE that matches the declared license, and
a wheel and an sdist that install and run `hivekeeper validate` in a clean virtual environment."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml

import hivekeeper
from conftest import EXAMPLES, REPO

CHART = REPO / "charts" / "hivekeeper"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# What `hivekeeper validate` imports beyond the standard library (tests/test_release.py checks
# that a venv holding only these and the wheel validates a manifest).
VALIDATE_NEEDS = ("pydantic", "pyyaml")


def test_one_version_across_package_chart_image_and_cli():
    version = hivekeeper.__version__
    # pyproject.toml reads it from hivekeeper.__version__: the one place it is written.
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "hivekeeper.__version__"}
    installed = importlib.metadata.version("hivekeeper")
    assert installed == version, (f"the installed metadata says {installed}, the source {version}: "
                                  "reinstall (pip install -e . --no-deps)")
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == version and chart["appVersion"] == version
    # The images default to the chart's appVersion (templates/_helpers.tpl): no tag of their own.
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["tag"] == "" and values["swarmImage"]["tag"] == ""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert "(default .Chart.AppVersion .Values.image.tag)" in helpers
    assert "(default .Chart.AppVersion .Values.swarmImage.tag)" in helpers
    cli = subprocess.run([sys.executable, "-m", "hivekeeper", "--version"], capture_output=True, text=True,
                         timeout=60, check=True)
    assert cli.stdout.strip() == f"hivekeeper {version}"


def test_license_file_matches_the_declared_license():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"  # an SPDX expression, not a table
    assert not any(c.startswith("License ::") for c in PYPROJECT["project"].get("classifiers", ()))
    requires = PYPROJECT["build-system"]["requires"]
    assert "setuptools>=77" in requires, "SPDX license strings need setuptools 77 or later"
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text


def copy_checkout(dest: Path) -> Path:
    """The files git tracks or would track (committed or not), as a fresh clone would have them
    once this change is committed; nothing ignored (no .venv, no build outputs)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                            capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    return dest


@pytest.mark.timeout(600)
def test_wheel_and_sdist_install_into_a_clean_venv_and_validate(tmp_path):
    """`python -m build` makes an sdist, then a wheel from that sdist; the wheel, installed with
    `--no-deps` into a new venv beside only the packages `hivekeeper validate` imports (pydantic
    and pyyaml, from the package index at the versions this environment has), validates an
    example manifest, and torch is not there to import.

    What it proves: the sdist holds everything a wheel needs; the wheel holds both packages, the
    `hivekeeper` entry point, the license and the version; the build prints no license
    deprecation; validation needs neither torch nor hivemind.
    What it does not: that the full dependency set resolves and installs (torch alone is 3 GB;
    tests/test_image_install.py installs the package as the image does and starts every pod's
    command), or that an isolated build fetches its backend (the build runs with
    `--no-isolation`, on this environment's setuptools)."""
    pytest.importorskip("build", reason="the test extra's `build` is not installed (pip install -e '.[test]')")
    source = copy_checkout(tmp_path / "src")
    dist = tmp_path / "dist"
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)],
                           capture_output=True, text=True, timeout=300)
    output = built.stdout + built.stderr
    assert built.returncode == 0, output[-4000:]
    assert "project.license" not in output and "License classifiers are deprecated" not in output, output[-4000:]
    version = hivekeeper.__version__
    wheel = dist / f"hivekeeper-{version}-py3-none-any.whl"
    sdist = dist / f"hivekeeper-{version}.tar.gz"
    assert wheel.is_file() and sdist.is_file(), sorted(p.name for p in dist.iterdir())

    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    assert {"LICENSE", "README.md", "pyproject.toml", "services/hivekeeper/cli.py",
            "operator/hivekeeper_operator/__init__.py"} <= names
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"hivekeeper-{version}.dist-info"
        metadata = archive.read(f"{info}/METADATA").decode()
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert {"hivekeeper/cli.py", "hivekeeper/spec/swarm.py", "hivekeeper_operator/__init__.py",
            f"{info}/licenses/LICENSE"} <= names
    assert f"Version: {version}\n" in metadata and "License-Expression: Apache-2.0\n" in metadata
    assert "hivekeeper = hivekeeper.cli:main" in entry_points

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    pins = [f"{name}=={importlib.metadata.version(name)}" for name in VALIDATE_NEEDS]
    for args in (["--no-deps", str(wheel)], pins):
        installed = subprocess.run(pip + args, capture_output=True, text=True, timeout=300)
        assert installed.returncode == 0, installed.stdout + installed.stderr

    def run(*args: str) -> subprocess.CompletedProcess:
        # From an empty directory, so nothing of the checkout can be imported by accident.
        return subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    assert run(str(venv / "bin" / "python"), "-c", "import torch").returncode != 0, "the venv is not clean"
    validated = run(str(venv / "bin" / "hivekeeper"), "validate", str(EXAMPLES / "swarm-digits.yaml"))
    assert validated.returncode == 0, validated.stdout + validated.stderr
    assert validated.stdout.strip().endswith("valid Swarm 'digits'")
    refused = run(str(venv / "bin" / "hivekeeper"), "validate", str(REPO / "pyproject.toml"))
    assert refused.returncode == 2 and refused.stderr.startswith("error: "), refused.stdout + refused.stderr
    assert run(str(venv / "bin" / "hivekeeper"), "--version").stdout.strip() == f"hivekeeper {version}"
    located = run(str(venv / "bin" / "python"), "-c", "import hivekeeper; print(hivekeeper.__file__)")
    assert located.stdout.startswith(str(venv)), located.stdout
