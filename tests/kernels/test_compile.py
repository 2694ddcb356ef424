"""Every kernels/*.cu compiles with nvcc for sm_80 and sm_90 without warnings or spills,
exports the kernels the wrappers launch, and kernels/README.md's resource table is current."""

import functools
import importlib.util
import shutil
from pathlib import Path

import pytest

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
_spec = importlib.util.spec_from_file_location("resource_report", KERNEL_DIR / "resource_report.py")
report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(report)

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
SOURCES = [path.name for path in report.sources()]


@functools.cache
def resources(name: str) -> dict:
    return report.compile_resources(KERNEL_DIR / name)  # one nvcc run covers both archs


def all_resources() -> dict:
    usage = {}
    for name in SOURCES:
        usage.update(resources(name))
    return usage


def test_every_kernel_source_is_covered():
    assert SOURCES == [
        "copy_blocks.cu",
        "fused_ops.cu",
        "lora_bgmv.cu",
        "paged_attention.cu",
        "paged_prefill.cu",
        "reshape_and_cache.cu",
        "w4a16.cu",
    ]


@pytest.mark.parametrize("source", SOURCES)
def test_compiles_for_sm80_and_sm90_without_warnings_or_spills(source):
    usage = resources(source)  # raises on any warning
    kernels = {kernel for kernel, _ in usage}
    assert set(usage) == {(kernel, arch) for kernel in kernels for arch in report.ARCHS}
    for (kernel, arch), used in usage.items():
        assert used["spill_stores"] == used["spill_loads"] == 0, (kernel, arch, used)
        assert used["registers"] <= 128, (kernel, arch, used)  # keeps 4 warps x 4 blocks per SM possible


def test_exports_every_kernel_the_wrappers_launch():
    kernels = {kernel for kernel, _ in all_resources()}
    expected = {"copy_blocks", "reshape_and_cache"}
    for dtype in ("f32", "f16", "bf16"):
        expected |= {f"lora_shrink_{dtype}", f"lora_expand_{dtype}"}
        expected |= {
            f"{name}_{dtype}" for name in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_and_cache")
        }
        for head_size in (64, 80, 96, 128):
            for variant in ("v1", "v2", "v2_reduce"):
                expected.add(f"paged_attention_{variant}_{dtype}_{head_size}")
            expected.add(f"paged_prefill_simt_{dtype}_{head_size}")
            if dtype != "f32":  # tensor cores: 16-bit inputs only
                expected.add(f"paged_prefill_mma_{dtype}_{head_size}")
            # over an fp8 e4m3 cache (v2's reduce is the one above)
            expected |= {f"paged_attention_{variant}_{dtype}_{head_size}_fp8" for variant in ("v1", "v2")}
            expected.add(f"paged_prefill_simt_{dtype}_{head_size}_fp8")
            if dtype != "f32":
                expected.add(f"paged_prefill_mma_{dtype}_{head_size}_fp8")
        expected.add(f"reshape_and_cache_{dtype}_fp8")  # K/V rows of dtype into an fp8 e4m3 cache
        expected.add(f"w4a16_reduce_{dtype}")
        for scale in ("f16", "f32"):  # raypaged.kernels.quant_ops: x's dtype, the scales' and the GEMV's rows
            expected.add(f"w4a16_dequant_{dtype}_s{scale}")
            expected |= {f"w4a16_gemv_{dtype}_s{scale}_r{rows}" for rows in (1, 2, 4, 8)}
    assert kernels == expected


def test_readme_resource_table_is_current():
    assert report.readme_table(KERNEL_DIR / "README.md") == report.markdown_table(all_resources()), (
        "run: python kernels/resource_report.py --write"
    )


def entry_bodies(ptx: str) -> dict[str, str]:
    return {chunk.split("(", 1)[0]: chunk for chunk in ptx.split(".visible .entry ")[1:]}


def test_fused_kernels_round_where_torch_rounds():
    """fused_ops.cu's rotary is bit for bit torch's only if no multiply-add is contracted into an
    FMA (torch rounds each product), and fused_add_rms_norm reads back the residual it wrote, so
    those loads must not go through the read-only (non-coherent) cache."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fused_ops.ptx"
        subprocess.run(
            ["nvcc", "-ptx", "-arch=sm_90", "-I", str(KERNEL_DIR), str(KERNEL_DIR / "fused_ops.cu"), "-o", str(out)],
            check=True,
            capture_output=True,
        )
        bodies = entry_bodies(out.read_text())
    for dtype in ("f32", "f16", "bf16"):
        rotary = bodies[f"rotary_and_cache_{dtype}"]
        assert "fma." not in rotary and "mad." not in rotary
        assert "st.global" in rotary
        add_norm = bodies[f"fused_add_rms_norm_{dtype}"]
        # the weight is the one read-only input: one vector and one scalar load of it
        assert add_norm.count("ld.global.nc") == 2, add_norm
