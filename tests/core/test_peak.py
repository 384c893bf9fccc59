import functools
from unittest import mock

import pytest
import torch

from lightning_accel.core import peak
from lightning_accel.core.peak import get_peak_flops, measure_peak_flops, normalize_dtype, resolve_peak_flops

T = 1e12

# (name as torch.cuda.get_device_name reports it, dtype, dense datasheet figure)
REAL_NAMES = [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4 * T),
    ("NVIDIA H100 80GB HBM3", "fp8", 1978.9 * T),
    ("NVIDIA H100 PCIe", torch.float16, 756 * T),
    ("NVIDIA H100 PCIe", "tf32", 378 * T),
    ("NVIDIA H100 NVL", torch.bfloat16, 835.5 * T),
    ("NVIDIA H200", torch.bfloat16, 989.4 * T),
    ("NVIDIA H200 NVL", torch.bfloat16, 835.5 * T),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312 * T),
    ("NVIDIA A100-SXM4-40GB", torch.float32, 19.5 * T),
    ("NVIDIA A100-PCIE-40GB", "tf32", 156 * T),
    ("NVIDIA A100 80GB PCIe", torch.float16, 312 * T),
    ("NVIDIA L4", torch.bfloat16, 121 * T),
    ("NVIDIA L40S", torch.bfloat16, 362.05 * T),
    ("NVIDIA L40", torch.float16, 181 * T),
    ("NVIDIA A10G", torch.bfloat16, 125 * T),
    ("NVIDIA A10", torch.float32, 31.2 * T),
    ("Tesla V100-SXM2-32GB", torch.float16, 125 * T),
    ("Tesla V100-PCIE-16GB", torch.float16, 112 * T),
    ("Tesla T4", torch.float16, 65 * T),
    ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165.2 * T),
    ("NVIDIA B200", torch.bfloat16, 2250 * T),
    ("NVIDIA B200", "fp8", 4500 * T),
]


@pytest.mark.parametrize(("name", "dtype", "expected"), REAL_NAMES)
def test_table_resolves_real_device_names(name, dtype, expected):
    assert get_peak_flops(name, dtype) == pytest.approx(expected)
    # the same through a CUDA device whose name is mocked
    with mock.patch("torch.cuda.get_device_name", return_value=name):
        assert get_peak_flops(torch.device("cuda", 0), dtype) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("Tesla V100-SXM2-32GB", torch.bfloat16),
        ("Tesla T4", "bf16"),
        ("NVIDIA A100-SXM4-80GB", "fp8"),
        ("Tesla T4", "tf32"),
    ],
)
def test_dtype_the_chip_lacks_is_none(name, dtype):
    assert get_peak_flops(name, dtype) is None


def test_unknown_device_and_cpu_are_none():
    assert get_peak_flops("Some Future GPU 9000", torch.float32) is None
    assert get_peak_flops("cpu", torch.float32) is None
    assert get_peak_flops(torch.device("cpu"), torch.bfloat16) is None


def test_dtype_spellings_and_unknown_dtype():
    assert normalize_dtype(torch.bfloat16) == normalize_dtype("bfloat16") == normalize_dtype("BF16") == "bf16"
    assert normalize_dtype("half") == normalize_dtype(torch.float16) == "fp16"
    assert normalize_dtype(torch.float8_e4m3fn) == "fp8"
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        get_peak_flops("NVIDIA H100 PCIe", "int3")


def test_measure_cpu_peak_is_positive_fast_and_cached():
    peak._MEASURED.clear()
    import time

    start = time.perf_counter()
    first = measure_peak_flops("cpu", torch.float32, budget_s=0.1)
    assert time.perf_counter() - start < 1.0
    assert 1e8 < first < 1e14  # between 0.1 GFLOP/s and 100 TFLOP/s for any CPU
    with mock.patch.object(torch, "mm", side_effect=AssertionError("not cached")):
        assert measure_peak_flops("cpu", "fp32") == first


def test_measure_rejects_fp8_and_bad_budget():
    with pytest.raises(ValueError, match="fp8"):
        measure_peak_flops("cpu", "fp8")
    with pytest.raises(ValueError, match="budget_s"):
        measure_peak_flops("cpu", "fp32", budget_s=0)


def test_resolve_order_user_table_then_cpu_hardware_or_probe():
    assert resolve_peak_flops("cpu", "fp32", 5e12).source == "user"
    with pytest.raises(ValueError, match="positive"):
        resolve_peak_flops("cpu", "fp32", -1.0)
    with mock.patch("torch.cuda.get_device_name", return_value="NVIDIA H100 PCIe"):
        got = resolve_peak_flops(torch.device("cuda", 0), torch.bfloat16)
    assert got.source == "table" and got.flops == 756 * T and "datasheet" in got.detail
    peak._MEASURED[("cpu", None, "fp32", torch.get_num_threads())] = 7e10
    with mock.patch.object(peak, "cpu_hardware_peak", return_value=None):  # a CPU the hardware table does not know
        got = resolve_peak_flops("cpu", torch.float32)
        assert got.source == "measured" and got.flops == 7e10 and got.detail.startswith("probe: 70.0 GFLOP/s")
        assert resolve_peak_flops("cpu", "fp64", measure=False) is None


def hardware(flops):
    return peak.PeakFlops(flops, "hardware", f"hardware: 2 cores x 2.25 GHz x 32 fp32 FLOP/cycle = {flops:g}")


@pytest.mark.parametrize(
    ("hardware_flops", "probe_flops", "source", "expected", "says"),
    [
        (100e9, 80e9, "hardware", 100e9, "the probe reached 80 % of it"),  # a probe under load reads low: not used
        (100e9, 120e9, "measured", 120e9, "above the hardware figure (2 cores x 2.25 GHz"),  # turbo: the probe wins
        (100e9, None, "hardware", 100e9, "hardware: 2 cores"),  # measure=False
    ],
)
def test_cpu_peak_is_the_larger_of_hardware_and_probe(hardware_flops, probe_flops, source, expected, says):
    with (
        mock.patch.object(peak, "cpu_hardware_peak", return_value=hardware(hardware_flops)),
        mock.patch.object(peak, "measure_peak_flops", return_value=probe_flops),
    ):
        got = resolve_peak_flops("cpu", "fp32", measure=probe_flops is not None)
    assert (got.source, got.flops) == (source, expected)
    assert says in got.detail


# ---------------------------------------------------------------------- the CPU's hardware peak from /proc/cpuinfo


def x86(
    n,
    *,
    vendor="GenuineIntel",
    family=6,
    model=106,
    name="Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz",
    mhz="2900.000",
    flags="fpu sse sse2 avx fma avx2 avx512f",
    core=None,
):
    return (
        f"processor\t: {n}\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n"
        f"model name\t: {name}\ncpu MHz\t\t: {mhz}\nphysical id\t: 0\ncore id\t\t: {n if core is None else core}\n"
        f"flags\t\t: {flags}\n"
    )


def arm(n, part, features="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp asimddp"):
    return (
        f"processor\t: {n}\nBogoMIPS\t: 243.75\nFeatures\t: {features}\nCPU implementer\t: 0x41\n"
        f"CPU architecture: 8\nCPU variant\t: 0x1\nCPU part\t: {part}\nCPU revision\t: 1\n"
    )


def fake_cpu(tmp_path, blocks, max_khz=None):
    """A fake /proc/cpuinfo (the blocks, blank-line separated) and cpufreq tree with cpuinfo_max_freq (kHz)."""
    (tmp_path / "cpuinfo").write_text("\n".join(blocks) + "\n")
    for n, khz in (max_khz or {}).items():
        (tmp_path / f"cpu{n}" / "cpufreq").mkdir(parents=True)
        (tmp_path / f"cpu{n}" / "cpufreq" / "cpuinfo_max_freq").write_text(f"{khz}\n")
    return dict(cpuinfo=tmp_path / "cpuinfo", sysfs_cpu=tmp_path)


ZEN2_FLAGS = "fpu sse sse2 ssse3 fma sse4_1 avx f16c avx2 sha_ni"

CPUS = {
    # name: (blocks, cpufreq max kHz per cpu, threads, dtype, cores x Hz x FLOP/cycle, words the detail must hold)
    "Ice Lake-SP, 2 cores with SMT, cpufreq": (
        [x86(0, core=0), x86(1, core=0), x86(2, core=1), x86(3, core=1)],
        {n: 3_500_000 for n in range(4)},
        4,
        "fp32",
        2 * 3.5e9 * 64,
        ["2 cores", "3.50 GHz (cpufreq max)", "64 fp32 FLOP/cycle", "AVX-512"],
    ),
    "Ice Lake-SP fp64": (
        [x86(0), x86(1)],
        {0: 3_500_000, 1: 3_500_000},
        2,
        "fp64",
        2 * 3.5e9 * 32,
        ["32 fp64 FLOP/cycle"],
    ),
    "Ice Lake-SP bf16 without bf16 instructions": (
        [x86(0), x86(1)],
        {0: 3_500_000, 1: 3_500_000},
        2,
        "bf16",
        2 * 3.5e9 * 64,
        ["runs on the fp32 FMA units"],
    ),
    "Sapphire Rapids bf16 on AMX": (
        [x86(0, flags="sse2 avx fma avx2 avx512f avx512_bf16 amx_bf16 amx_tile", model=143)],
        {0: 3_800_000},
        1,
        "bf16",
        3.8e9 * 1024,
        ["1024 bf16 FLOP/cycle", "AMX-BF16"],
    ),
    "AMD EPYC Zen 2 VM: no cpufreq, cpu MHz": (
        [
            x86(n, vendor="AuthenticAMD", family=23, model=49, name="AMD EPYC", mhz="2245.780", flags=ZEN2_FLAGS)
            for n in range(2)
        ],
        None,
        2,
        "fp32",
        2 * 2245.780e6 * 32,
        ["2 cores", "2.25 GHz (cpuinfo cpu MHz)", "32 fp32 FLOP/cycle", "AVX2 FMA"],
    ),
    "AMD Zen 1: 128-bit FMA pipes": (
        [x86(0, vendor="AuthenticAMD", family=23, model=1, name="AMD EPYC 7601", mhz="2200.000", flags=ZEN2_FLAGS)],
        {0: 3_200_000},
        1,
        "fp32",
        3.2e9 * 16,
        ["16 fp32 FLOP/cycle", "Zen/Zen+"],
    ),
    "AMD Zen 4: AVX-512 through 256-bit pipes, bf16 dot products": (
        [
            x86(
                0,
                vendor="AuthenticAMD",
                family=25,
                model=17,
                name="AMD EPYC 9654",
                mhz="2400.000",
                flags=ZEN2_FLAGS + " avx512f avx512_bf16",
            )
        ],
        {0: 3_700_000},
        1,
        "bf16",
        3.7e9 * 64,
        ["64 bf16 FLOP/cycle", "AVX512-BF16", "Zen 4"],
    ),
    "Sandy Bridge: AVX without FMA, base clock from the model name": (
        [x86(0, model=45, name="Intel(R) Xeon(R) CPU E5-2670 0 @ 2.60GHz", mhz="1200.000", flags="sse sse2 avx")],
        None,
        1,
        "fp32",
        2.6e9 * 16,
        ["2.60 GHz (model name)", "16 fp32 FLOP/cycle", "without FMA"],
    ),
    "SSE2 only": (
        [x86(0, model=23, name="Intel(R) Core(TM)2 Duo CPU E8400 @ 3.00GHz", mhz="3000.000", flags="sse sse2")],
        None,
        1,
        "fp32",
        3.0e9 * 8,
        ["8 fp32 FLOP/cycle", "SSE2"],
    ),
    "threads limit the cores": (
        [x86(n) for n in range(4)],
        {n: 2_000_000 for n in range(4)},
        1,
        "fp32",
        2e9 * 64,
        ["1 core x"],
    ),
    "aarch64 Neoverse N1 (Graviton2), cpufreq": (
        [arm(n, "0xd0c") for n in range(2)],
        {0: 2_500_000, 1: 2_500_000},
        2,
        "fp32",
        2 * 2.5e9 * 16,
        ["2 cores", "16 fp32 FLOP/cycle", "Neoverse N1"],
    ),
    "aarch64 Neoverse V1 (Graviton3) with SVE": (
        [arm(0, "0xd40", features="fp asimd sve bf16")],
        {0: 2_600_000},
        1,
        "fp32",
        2.6e9 * 32,
        ["32 fp32 FLOP/cycle", "Neoverse V1"],
    ),
}


@pytest.mark.parametrize("case", CPUS, ids=list(CPUS))
def test_cpu_hardware_peak_from_cpuinfo_and_cpufreq(tmp_path, case):
    blocks, khz, threads, dtype, expected, words = CPUS[case]
    got = peak.cpu_hardware_peak(dtype, threads=threads, affinity=range(len(blocks)), **fake_cpu(tmp_path, blocks, khz))
    assert got.source == "hardware" and got.detail.startswith("hardware: ")
    assert got.flops == pytest.approx(expected)
    for word in words:
        assert word in got.detail


def test_cpu_hardware_peak_counts_only_the_cpus_of_the_affinity(tmp_path):
    paths = fake_cpu(tmp_path, [x86(n) for n in range(4)], {n: 2_000_000 for n in range(4)})
    assert peak.cpu_hardware_peak("fp32", threads=8, affinity={0, 1, 2, 3}, **paths).flops == 4 * 2e9 * 64
    assert peak.cpu_hardware_peak("fp32", threads=8, affinity={2}, **paths).flops == 2e9 * 64


UNKNOWN = {
    "aarch64 part not in the table": ([arm(0, "0xd03")], {0: 1_500_000}, "fp32"),
    "aarch64 without a clock": ([arm(0, "0xd0c")], None, "fp32"),
    "aarch64 bf16": ([arm(0, "0xd40", features="fp asimd sve bf16")], {0: 2_600_000}, "bf16"),
    "ppc64le": (
        ["processor\t: 0\ncpu\t\t: POWER9 (raw), altivec supported\nclock\t\t: 3800.000000MHz\n"],
        None,
        "fp32",
    ),
    "x86 fp8": ([x86(0)], {0: 3_000_000}, "fp8"),
    "no cpuinfo": ([], None, "fp32"),
}


@pytest.mark.parametrize("case", UNKNOWN, ids=list(UNKNOWN))
def test_unknown_cpu_has_no_hardware_figure_and_the_probe_is_the_peak(tmp_path, case):
    blocks, khz, dtype = UNKNOWN[case]
    paths = fake_cpu(tmp_path, blocks, khz)
    if not blocks:
        paths["cpuinfo"] = tmp_path / "missing"
    assert peak.cpu_hardware_peak(dtype, threads=1, affinity={0}, **paths) is None
    if dtype == "fp32":
        on_this_cpu = functools.partial(peak.cpu_hardware_peak, threads=1, affinity={0}, **paths)
        with (
            mock.patch.object(peak, "cpu_hardware_peak", on_this_cpu),
            mock.patch.object(peak, "measure_peak_flops", return_value=3e10),
        ):
            got = resolve_peak_flops("cpu", dtype)
        assert got.source == "measured" and got.flops == 3e10 and got.detail.startswith("probe: ")
