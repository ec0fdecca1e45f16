"""Stage what bench/e2e_gpu.sh needs on a GPU machine without network: TE wheels, Megatron-LM.

    python bench/e2e_stage.py STAGE --mcore-repo PATH [--commit d98e8a64dd] [--te-torch-wheel W]
        [--keep-arch 90] [--release core_v0.19.0]

Writes STAGE/mlm-main.tar.gz (`git archive` of the files pretrain_gpt.py needs and the tests the
series patches), with --release TAG also STAGE/mlm-TAG.tar.gz (scenario 4 of e2e_gpu.sh resumes
on a release, which lacks upstream's fixes that main has), and STAGE/whl/: Transformer Engine
2.20.2 for CUDA 13 / Python 3.12 and the packages it needs that the H200 image lacks (`pip
download`), plus the prebuilt transformer_engine_torch wheel given with --te-torch-wheel. The
transformer-engine-cu13 wheel (276 MB, over a 64 MiB transfer limit) is rewritten smaller: in
its libtransformer_engine.so the CUDA fatbin entries for other GPU architectures than
--keep-arch are zeroed (headers kept), so the library compresses to about 32 MB and the CUDA
runtime still finds the sm_90 cubins it loads on an H200. The wheel's RECORD gets the new hash.
Only for a machine of that architecture.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

TE_VERSION = "2.20.2"
WHEELS = [
    f"transformer-engine-cu13=={TE_VERSION}",
    f"transformer-engine=={TE_VERSION}",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing-extensions==4.16.0",
    "importlib-metadata==10.2.0",
    "nvdlfw-inspect==0.2.2",
    "nvidia-cudnn-frontend==1.32.0",
]
MLM_PATHS = [
    "megatron",
    "pretrain_gpt.py",
    "gpt_builders.py",
    "model_provider.py",
    "tests/__init__.py",
    "tests/test_utils",
    "tests/unit_tests",
]
FATBIN_MAGIC = 0xBA55ED50
LIBRARY = "transformer_engine/wheel_lib/libtransformer_engine.so"


def section(elf: bytes, name: str) -> tuple[int, int]:
    """File offset and size of an ELF64 little-endian section."""
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    strtab_off = struct.unpack_from("<Q", elf, shoff + shstrndx * shentsize + 0x18)[0]
    for i in range(shnum):
        base = shoff + i * shentsize
        name_off = struct.unpack_from("<I", elf, base)[0]
        end = elf.index(b"\0", strtab_off + name_off)
        if elf[strtab_off + name_off : end].decode() == name:
            off, size = struct.unpack_from("<QQ", elf, base + 0x18)
            return off, size
    raise ValueError(f"no section {name}")


def zero_other_archs(elf: bytearray, keep_arch: int) -> tuple[int, int]:
    """Zero the payload of every fatbin entry for another architecture; (kept, zeroed) bytes."""
    off, size = section(bytes(elf), ".nv_fatbin")
    pos, end, kept, zeroed = off, off + size, 0, 0
    while pos < end:
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", elf, pos)
        if magic != FATBIN_MAGIC:
            if magic != 0:
                raise ValueError(f"unexpected fatbin data at {pos:#x}")
            pos += 8  # alignment padding between containers
            continue
        entry, container_end = pos + header_size, pos + header_size + fat_size
        while entry < container_end:
            _kind, _flags, entry_header, payload = struct.unpack_from("<HHIQ", elf, entry)
            arch = struct.unpack_from("<I", elf, entry + 28)[0]
            start = entry + entry_header
            if arch == keep_arch:
                kept += payload
            else:
                elf[start : start + payload] = bytes(payload)
                zeroed += payload
            entry = start + payload
        pos = container_end
    return kept, zeroed


def slim_wheel(wheel: Path, keep_arch: int) -> None:
    """Rewrite the TE core wheel in place with the library's other architectures zeroed."""
    with zipfile.ZipFile(wheel) as src:
        members = {info.filename: src.read(info) for info in src.infolist()}
    library = bytearray(members[LIBRARY])
    kept, zeroed = zero_other_archs(library, keep_arch)
    members[LIBRARY] = bytes(library)
    digest = base64.urlsafe_b64encode(hashlib.sha256(library).digest()).rstrip(b"=").decode()
    record = next(n for n in members if n.endswith(".dist-info/RECORD"))
    lines = members[record].decode().splitlines()
    lines = [
        f"{LIBRARY},sha256={digest},{len(library)}" if line.startswith(LIBRARY + ",") else line
        for line in lines
    ]
    members[record] = ("\n".join(lines) + "\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for name, data in members.items():
            dst.writestr(name, data)
    wheel.write_bytes(buffer.getvalue())
    print(
        f"{wheel.name}: kept {kept / 1e6:.0f} MB of sm_{keep_arch} cubins, zeroed "
        f"{zeroed / 1e6:.0f} MB; wheel now {wheel.stat().st_size / 1e6:.0f} MB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", type=Path)
    parser.add_argument("--mcore-repo", type=Path, required=True)
    parser.add_argument("--commit", default="d98e8a64dd")
    parser.add_argument("--te-torch-wheel", type=Path)
    parser.add_argument("--keep-arch", type=int, default=90)
    parser.add_argument("--release", action="append", default=[], help="a release tag, repeatable")
    args = parser.parse_args()
    whl = args.stage / "whl"
    whl.mkdir(parents=True, exist_ok=True)
    for name, commit in [("main", args.commit)] + [(tag, tag) for tag in args.release]:
        with (args.stage / f"mlm-{name}.tar.gz").open("wb") as f:
            cmd = ["git", "-C", str(args.mcore_repo), "archive", "--format=tar.gz", commit]
            subprocess.run([*cmd, *MLM_PATHS], stdout=f, check=True)
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "-d", str(whl)]
    for platform in platforms:
        cmd += ["--platform", platform]
    subprocess.run([*cmd, *WHEELS], check=True)
    core = next(whl.glob(f"transformer_engine_cu13-{TE_VERSION}-*.whl"))
    if core.stat().st_size > 64 * 2**20:
        slim_wheel(core, args.keep_arch)
    if args.te_torch_wheel:
        (whl / args.te_torch_wheel.name).write_bytes(args.te_torch_wheel.read_bytes())
    total = sum(p.stat().st_size for p in args.stage.rglob("*") if p.is_file())
    print(f"{args.stage}: {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
