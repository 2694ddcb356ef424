"""Compile every kernels/*.cu with nvcc for sm_80 and sm_90 and report ptxas resource usage.

    python kernels/resource_report.py           # print the markdown table
    python kernels/resource_report.py --write   # refresh it in kernels/README.md
    python kernels/resource_report.py --check   # exit 1 if README.md's table is stale

Warnings are errors (``-Werror all-warnings``): a file that warns fails to compile.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

KERNEL_DIR = Path(__file__).resolve().parent
ARCHS = ("sm_80", "sm_90")
BEGIN, END = "<!-- resource-report:begin -->", "<!-- resource-report:end -->"

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def nvcc_command(source: Path, output: Path) -> list[str]:
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in ARCHS]
    # --threads 0: the archs compile side by side, one thread each up to the CPU count (ptxas prints each arch's
    # report whole, so the parse below is the same; the sources take half the time on 2 cores)
    return [
        "nvcc",
        "-c",
        str(source),
        "-o",
        str(output),
        *gencode,
        "-Werror",
        "all-warnings",
        "-Xptxas",
        "-v",
        "--threads",
        "0",
    ]


def compile_resources(source: Path) -> dict[tuple[str, str], dict[str, int]]:
    """{(kernel, arch): {registers, stack, spill_stores, spill_loads, smem}}; raises on any warning or error."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(nvcc_command(source, Path(tmp) / "out.o"), capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0 or "warning" in log.lower():
        raise RuntimeError(f"nvcc failed on {source.name}:\n{log}")
    usage: dict[tuple[str, str], dict[str, int]] = {}
    current: dict[str, int] = {}
    for line in log.splitlines():
        if entry := _ENTRY.search(line):
            current = usage.setdefault((entry[1], entry[2]), {})
        elif spills := _SPILLS.search(line):
            current.update(stack=int(spills[1]), spill_stores=int(spills[2]), spill_loads=int(spills[3]))
        elif used := _USED.search(line):
            current.update(registers=int(used[1]), smem=int(used[2] or 0))
    return usage


def sources() -> list[Path]:
    return sorted(KERNEL_DIR.glob("*.cu"))


def markdown_table(usage: dict[tuple[str, str], dict[str, int]]) -> str:
    header = "| kernel | " + " | ".join(f"{a} regs / spill st,ld B / static smem B" for a in ARCHS) + " |"
    lines = [header, "|---|" + "---|" * len(ARCHS)]
    for kernel in sorted({k for k, _ in usage}):
        cells = []
        for arch in ARCHS:
            u = usage[(kernel, arch)]
            cells.append(f"{u['registers']} / {u['spill_stores']},{u['spill_loads']} / {u['smem']}")
        lines.append(f"| `{kernel}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def full_report() -> str:
    usage: dict[tuple[str, str], dict[str, int]] = {}
    for source in sources():
        usage.update(compile_resources(source))
    return markdown_table(usage)


def readme_table(readme: Path) -> str:
    text = readme.read_text()
    return text[text.index(BEGIN) + len(BEGIN) : text.index(END)].strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="refresh the table in kernels/README.md")
    mode.add_argument("--check", action="store_true", help="fail if kernels/README.md's table is stale")
    args = parser.parse_args()
    table = full_report()
    readme = KERNEL_DIR / "README.md"
    if args.write:
        text = readme.read_text()
        start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
        readme.write_text(text[:start] + "\n" + table + "\n" + text[end:])
    elif args.check:
        if readme_table(readme) != table:
            print("kernels/README.md resource table is stale: run python kernels/resource_report.py --write")
            return 1
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
