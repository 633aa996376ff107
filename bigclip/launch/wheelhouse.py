"""Wheels of bigclip and its non-torch dependencies, for GPU nodes without internet.

    python -m bigclip.launch.wheelhouse --python-version 3.12 --platform manylinux_2_28_x86_64 \
        --extras s3,deepspeed,int8 --out wheelhouse/        # `make wheelhouse` runs this
    # on the node, where torch is installed already:
    pip install --no-index --find-links wheelhouse/ 'bigclip[s3,deepspeed,int8]'

1. bigclip itself as a wheel; DeepSpeed (an sdist that imports torch while building) built into
   a wheel here with DS_BUILD_OPS=0 (its ops JIT-compile on the node), when the extras ask for it;
   s3torchconnector (PyPI has only its sdist; pure Python) built into a wheel for [s3].
2. pip resolves bigclip[extras] for the target Python and platform without installing anything
   (`pip install --dry-run --report`), binary wheels only.
3. Every resolved package is downloaded as a wheel for that target, except torch and what
   ships with it (triton, nvidia-*, cuda-*): the node's torch build is the one to keep.
Needs pip >= 23 and the index reachable from this machine; the target need not be this one.
`--only "REQ ..."` downloads just those requirements and their dependencies (`make gpu-wheels`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Installed with torch on a GPU node (its CUDA build pins them): never put into the wheelhouse.
FROM_TORCH = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|pytorch-triton.*)$")


def platform_tags(platform: str) -> list[str]:
    """`manylinux_2_28_x86_64` and every older manylinux tag it accepts (pip matches exactly)."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    glibc, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{n}_{arch}" for n in range(glibc, 16, -1)]
    return tags + [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]


def target_options(python_version: str, platform: str) -> list[str]:
    options = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for tag in platform_tags(platform):
        options += ["--platform", tag]
    return options


def pip(*args: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env=env)


# Pure-Python dependencies PyPI serves only as sdists: built into wheels here, per extra.
SDIST_ONLY = {"s3": ["s3torchconnector"]}


def build_local_wheels(out: Path, *, deepspeed: str | None, extras: list[str]) -> list[Path]:
    """bigclip's wheel, DeepSpeed's when asked for, and the sdist-only ones; returns the first two."""
    pip("wheel", "--no-deps", "-q", "-w", str(out), str(ROOT))
    for package in (p for extra in extras for p in SDIST_ONLY.get(extra, [])):
        pip("wheel", "--no-deps", "-q", "-w", str(out), package)
    if deepspeed:
        env = {**os.environ, "DS_BUILD_OPS": "0"}
        pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), deepspeed, env=env)
    return sorted(out.glob("bigclip-*.whl")) + sorted(out.glob("deepspeed-*.whl"))


def resolve(requirements: list[str], options: list[str], find_links: Path) -> list[tuple[str, str]]:
    """(name, version) of everything pip would install for the target."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        pip("install", "--dry-run", "--ignore-installed", "-q", "--report", str(report), "--target",
            str(Path(tmp) / "t"), "--find-links", str(find_links), *options, *requirements)  # fmt: skip
        installs = json.loads(report.read_text())["install"]
    return [(i["metadata"]["name"], i["metadata"]["version"]) for i in installs]


def build_wheelhouse(
    *, python_version: str, platform: str, extras: str, deepspeed: str, out: Path
) -> list[str]:
    """Fill `out`; returns the names of the packages downloaded for the target."""
    out.mkdir(parents=True, exist_ok=True)
    wanted = [e for e in extras.split(",") if e]
    local = build_local_wheels(out, deepspeed=deepspeed if "deepspeed" in wanted else None, extras=wanted)
    bigclip_wheel = str(local[0]) + (f"[{','.join(wanted)}]" if wanted else "")
    options = target_options(python_version, platform)
    resolved = resolve([bigclip_wheel, *map(str, local[1:])], options, out)
    built = {p.name.split("-")[0].lower().replace("_", "-") for p in out.glob("*.whl")}
    names = [
        (n, v)
        for n, v in resolved
        if not FROM_TORCH.match(n.lower()) and n.lower().replace("_", "-") not in built
    ]
    if names:
        pip("download", "--no-deps", "-q", "-d", str(out), *options, *(f"{n}=={v}" for n, v in names))
    return [n for n, _ in names]


def download_only(
    requirements: list[str], *, python_version: str, platform: str, out: Path, deps: bool = True
) -> list[Path]:
    """Just `requirements` (and their dependencies unless `deps` is False) as wheels for the
    target: what a node that has most of bigclip's dependencies already (a GPU image) lacks."""
    out.mkdir(parents=True, exist_ok=True)
    no_deps = [] if deps else ["--no-deps"]
    pip("download", "-q", *no_deps, "-d", str(out), *target_options(python_version, platform), *requirements)
    return sorted(out.glob("*.whl"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python-version", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64")
    parser.add_argument("--extras", default="s3,deepspeed,int8", help="bigclip extras, comma-separated")
    parser.add_argument("--deepspeed", default="deepspeed==0.19.8", help="the DeepSpeed to build")
    parser.add_argument("--out", type=Path, default=Path("wheelhouse"))
    parser.add_argument(
        "--only", default="", help="download just these requirements (space-separated) and their dependencies"
    )
    parser.add_argument("--no-deps", action="store_true", help="with --only: without their dependencies")
    args = parser.parse_args(argv)
    if args.only:
        wheels = download_only(args.only.split(), python_version=args.python_version, platform=args.platform,
                               out=args.out, deps=not args.no_deps)  # fmt: skip
        print(f"{len(wheels)} wheels in {args.out}; on the node:")
        print(f"  pip install --no-index --no-deps {args.out}/*.whl")
        return 0
    names = build_wheelhouse(python_version=args.python_version, platform=args.platform,
                             extras=args.extras, deepspeed=args.deepspeed, out=args.out)  # fmt: skip
    print(
        f"{len(list(args.out.glob('*.whl')))} wheels in {args.out} ({len(names)} dependencies); on the node:"
    )
    print(f"  pip install --no-index --find-links {args.out} 'bigclip[{args.extras}]'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
