"""The Python packages the GPU machine lacks, carried with the tree as wheels (nothing can be downloaded there).

Build the folder here, once (about 0.25 MiB; git-ignored, so `run` must name it in `carry`):

    .venv/bin/python -m bench.gpu.wheels

The GPU machine's image has torch 2.11, transformers 5.17, huggingface_hub, safetensors, tokenizers, tqdm,
numpy, PyYAML and tensorboard, but not omegaconf (pure Python). `use_wheels()` unpacks every wheel of the folder into a temporary site folder and puts it first on
sys.path and on PYTHONPATH, so torchrun's workers find it too.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / "wheels"
# omegaconf 2.4.0 is what constraints.txt pins; it needs only PyYAML, which the GPU machine has (2.3 needed antlr4)
WHEELS = ["omegaconf==2.4.0"]
MODULES = ["omegaconf"]  # what the run imports from them


def build(folder: Path = FOLDER) -> list[Path]:
    """Download the wheels (no dependencies: the rest is on the GPU machine) into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(folder), *WHEELS], check=True)
    return sorted(folder.glob("*.whl"))


def missing() -> list[str]:
    import importlib.util
    return [m for m in MODULES if importlib.util.find_spec(m) is None]


def use_wheels(folder: Path = FOLDER) -> str:
    """Make the carried wheels importable here and in child processes; returns what was done, for the report."""
    lacking = missing()
    if not lacking:
        return "all packages present"
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"this machine lacks {', '.join(lacking)} and {folder} holds no wheels: build them with "
                         "`python -m bench.gpu.wheels` and carry bench/gpu/wheels with the tree")
    site = Path(tempfile.mkdtemp(prefix="tandem-wheels-"))
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return f"unpacked {', '.join(w.name for w in wheels)} for {', '.join(lacking)}"


if __name__ == "__main__":
    built = build()
    total = sum(w.stat().st_size for w in built)
    print("\n".join(f"{w.name}  {w.stat().st_size / 1024:.0f} KiB" for w in built))
    print(f"{len(built)} wheels, {total / 2**20:.2f} MiB in {FOLDER}")
