"""gpu-carry: the wheels an offline GPU machine lacks for pagedcore's GPU run, and nothing else (docs/gpu.md).

``make gpu-carry`` (``python scripts/gpu_carry.py [--carry carry]``), on a machine with the package index, empties
``carry/`` and fills it with:

- each package the GPU run needs (pyproject.toml's dependencies, its ``transformers`` and ``gpu`` extras, and the
  test runner's packages) that the image (scripts/gpu_image.txt) lacks or has at a version pyproject does not
  accept, at the version pinned in :data:`PINS` (transformers: pyproject's floor, the version CI proves);
- the pip wheel, which ``scripts/gpu_run.sh`` runs by its file name only where the image's python has no pip;
- a pagedcore wheel built from this tree, in the same command, and ``MANIFEST.json``: what was carried and why,
  what the image already has, and a digest of the tree the wheel was built from (the run checks it against the tree
  it finds, so a stale carry is reported).

Wheels are fetched for the image's Python (cp312, manylinux x86_64) with ``--no-deps``: what they need is checked here
against the image list instead. ``carry/`` is git-ignored: name it when sending the tree to the GPU machine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
IMAGE_LIST = ROOT / "scripts" / "gpu_image.txt"
PYTHON = "3.12"  # the image's
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
RUN_EXTRAS = ("transformers", "gpu")  # what the GPU run imports beyond pagedcore's own dependencies
RUN_TEST_PACKAGES = ("pytest", "pytest-timeout", "hypothesis")  # of the test extra: the runner of the GPU tests
# The version carried when the image lacks a package. transformers is not here: its pin is pyproject's floor.
PINS = {"xformers": "0.0.35", "nvidia-cuda-runtime-cu12": "12.8.90"}  # 12.8: what xformers 0.0.35 was built for


@dataclass(frozen=True)
class ImagePackage:
    """One line of scripts/gpu_image.txt."""

    name: str
    version: str | None  # None: there, version not read
    rehearsal: str  # "=", "-" or a pip requirement


def read_image(path: Path = IMAGE_LIST) -> dict[str, ImagePackage]:
    """The image's packages by canonical name (``python`` included, as a pseudo-package)."""
    packages = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, version, rehearsal = line.split()
        packages[canonicalize_name(name)] = ImagePackage(name, None if version == "?" else version, rehearsal)
    return packages


def rehearsal_requirements(image: dict[str, ImagePackage]) -> list[str]:
    """What the CPU venv standing in for the image installs: column 3 of scripts/gpu_image.txt."""
    wanted = []
    for key, package in image.items():
        if key == "python" or package.rehearsal == "-":
            continue
        wanted.append(f"{package.name}=={package.version}" if package.rehearsal == "=" else package.rehearsal)
    return wanted


def run_requirements(pyproject: Path = ROOT / "pyproject.toml") -> list[Requirement]:
    """What the GPU run needs installed: pagedcore's dependencies, :data:`RUN_EXTRAS`, :data:`RUN_TEST_PACKAGES`."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *(spec for extra in RUN_EXTRAS for spec in extras[extra])]
    wanted += [spec for spec in extras["test"] if canonicalize_name(Requirement(spec).name) in RUN_TEST_PACKAGES]
    return [Requirement(spec) for spec in wanted]


def floor(requirement: Requirement) -> str:
    """The lowest version ``requirement`` allows through a ``>=`` or ``==`` clause (its declared floor)."""
    bounds = [s.version for s in requirement.specifier if s.operator in (">=", "==")]
    if not bounds:
        raise SystemExit(f"gpu-carry: {requirement} declares no floor (>= or ==): cannot choose what to carry")
    return str(max(bounds, key=Version))


def plan(requirements: list[Requirement], image: dict[str, ImagePackage]) -> tuple[dict[str, str], list[str]]:
    """``({name: version to carry}, [what the image already satisfies, as lines])``."""
    carry: dict[str, str] = {}
    kept = []
    for requirement in requirements:
        key = canonicalize_name(requirement.name)
        have = image.get(key)
        if have is not None and (
            have.version is None or requirement.specifier.contains(have.version, prereleases=True)
        ):
            kept.append(f"{requirement}: the image has {have.version or 'it (version not read)'}")
            continue
        version = floor(requirement) if key == "transformers" else PINS.get(key)
        if version is None:
            raise SystemExit(f"gpu-carry: the image lacks {requirement}; add its version to PINS in {__file__}")
        if not requirement.specifier.contains(version, prereleases=True):
            raise SystemExit(f"gpu-carry: PINS has {key}=={version}, which {requirement} does not accept")
        carry[key] = version
    return carry, kept


def tree_digest(root: Path = ROOT) -> str:
    """sha256 of the files a pagedcore wheel is built from (pagedcore/**/*.py, py.typed, pyproject.toml)."""
    digest = hashlib.sha256()
    files = sorted(p for p in (root / "pagedcore").rglob("*") if p.suffix == ".py" or p.name == "py.typed")
    for path in [*files, root / "pyproject.toml"]:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def git_state(root: Path = ROOT) -> dict[str, object]:
    """The commit checked out and whether the tree differs from it (None where there is no git)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", *args]
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True)


def download(carry: Path, pins: dict[str, str]) -> None:
    """Fetch ``pins`` (and pip) as cp312 manylinux wheels, without their dependencies."""
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    pip_version = f"pip=={_running_pip()}"
    specs = [f"{name}=={version}" for name, version in sorted(pins.items())] + [pip_version]
    pip("download", "--quiet", "--retries", "5", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON,
        "--implementation", "cp", *platforms, "-d", str(carry), *specs)  # fmt: skip


def wheel_requirements(wheel: Path) -> list[Requirement]:
    """The dependencies a wheel declares (``Requires-Dist``) that apply on the image (Python 3.12, Linux, no extra)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    environment = {**default_environment(), "python_version": PYTHON, "python_full_version": f"{PYTHON}.3"}
    environment.update(sys_platform="linux", platform_system="Linux", platform_machine="x86_64", extra="")
    requirements = [
        Requirement(line.split(":", 1)[1]) for line in metadata.splitlines() if line.startswith("Requires-Dist:")
    ]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(environment)]


def check_dependencies(carry: Path, image: dict[str, ImagePackage], carried: dict[str, str]) -> list[str]:
    """Each carried wheel's dependencies against the image and the carry; raises SystemExit naming what is missing."""
    lines, missing = [], []
    for wheel in sorted(carry.glob("*.whl")):
        for requirement in wheel_requirements(wheel):
            key = canonicalize_name(requirement.name)
            version = carried.get(key) or (image[key].version if key in image else None)
            if key not in carried and key not in image:
                missing.append(f"{wheel.name} needs {requirement}: not on the image, not carried")
            elif version is not None and not requirement.specifier.contains(version, prereleases=True):
                missing.append(f"{wheel.name} needs {requirement}: the image has {version}")
            else:
                lines.append(f"{wheel.name} needs {requirement}: {'carried' if key in carried else 'on the image'}")
    if missing:
        raise SystemExit("gpu-carry: " + "; ".join(missing) + " (add it to PINS, or correct scripts/gpu_image.txt)")
    return lines


def _running_pip() -> str:
    import pip as running

    return running.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--carry", type=Path, default=ROOT / "carry", help="the folder to (re)fill (default: carry)")
    parser.add_argument("--rehearsal-requirements", action="store_true", help="print the image venv's requirements")
    args = parser.parse_args(argv)
    if args.rehearsal_requirements:
        print("\n".join(rehearsal_requirements(read_image())))
        return 0
    carry: Path = args.carry
    image = read_image()
    pins, kept = plan(run_requirements(), image)
    shutil.rmtree(carry, ignore_errors=True)  # one version of each wheel: two would stop the whole install
    carry.mkdir(parents=True)
    download(carry, pins)
    needs = check_dependencies(carry, image, pins)
    pip("wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(carry), str(ROOT))
    wheels = sorted(p.name for p in carry.glob("*.whl"))
    manifest = {
        "python": PYTHON,
        "carried": {name: version for name, version in sorted(pins.items())},
        "fallback": [w for w in wheels if re.match(r"pip-", w)],
        "image_has": kept,
        "carried_wheels_need": needs,
        "wheels": wheels,
        "tree_sha256": tree_digest(),
        **git_state(),
    }
    (carry / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    size = sum(p.stat().st_size for p in carry.iterdir())
    print(f"gpu-carry: {len(wheels)} wheels, {size / 2**20:.1f} MiB in {carry}: {', '.join(wheels)}")
    for line in kept:
        print(f"  not carried: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
