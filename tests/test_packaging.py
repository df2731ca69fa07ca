"""One import name: an install of megazero adds the top-level name ``megazero`` and no other, and the source
tree's kernels/, models/ and parallel/ folders shadow no installed distribution of those names."""
import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "megazero", "models", "parallel", "kernels")


def _wheel_names(tmp_path: Path) -> tuple[set[str], set[str]]:
    """Top-level names and megazero's subpackages in a wheel built from a copy of the tree (a build in place
    would leave build/ behind)."""
    src = tmp_path / "src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(ROOT / name, src / name)
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                          "-w", str(tmp_path / "wheel"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("megazero-*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    tops = {f.split("/")[0] for f in files if not f.split("/")[0].endswith(".dist-info")}
    subs = {f.split("/")[1] for f in files if f.startswith("megazero/") and f.count("/") >= 2}
    return tops, subs


def test_a_wheel_installs_only_megazero(tmp_path):
    tops, subs = _wheel_names(tmp_path)
    assert tops == {"megazero"}, tops
    assert {"models", "parallel", "kernels", "plan", "train"} <= subs, subs  # the mapped folders are inside


def test_the_installed_distribution_names_only_megazero():
    """What `make setup`'s editable install declares (pip's record of top-level names)."""
    top_level = importlib.metadata.distribution("megazero").read_text("top_level.txt") or ""
    assert top_level.split() == ["megazero"], top_level
    names = {name for name, dists in importlib.metadata.packages_distributions().items() if "megazero" in dists}
    assert names == {"megazero"}, names


def test_the_trees_folders_shadow_no_installed_package():
    """From the tree's root (where ``python pretrain.py`` and pytest put it first on sys.path), a bare ``import
    kernels`` finds Hugging Face's installed ``kernels`` (transformers imports it), and ``import models``
    finds nothing; megazero's own modules still import, by their one name."""
    code = ("import importlib.util, kernels, megazero.kernels.attend as a, megazero.models.build as b; "
            "print(kernels.__file__); print(importlib.util.find_spec('models') is None or "
            "importlib.util.find_spec('models').origin); print(a.__file__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    hub, models, attend = out.stdout.split()
    assert "site-packages" in hub and not hub.startswith(str(ROOT / "kernels")), hub
    assert models in ("True", "None"), models  # no module; a namespace portion has no origin
    assert attend == str(ROOT / "kernels" / "attend.py"), attend
