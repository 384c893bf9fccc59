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


@pytest.mark.parametrize(("name", "dtype"), [("Tesla V100-SXM2-32GB", torch.bfloat16), ("Tesla T4", "bf16"),
                                             ("NVIDIA A100-SXM4-80GB", "fp8"), ("Tesla T4", "tf32")])
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


def test_resolve_order_user_table_measured():
    assert resolve_peak_flops("cpu", "fp32", 5e12).source == "user"
    with pytest.raises(ValueError, match="positive"):
        resolve_peak_flops("cpu", "fp32", -1.0)
    with mock.patch("torch.cuda.get_device_name", return_value="NVIDIA H100 PCIe"):
        got = resolve_peak_flops(torch.device("cuda", 0), torch.bfloat16)
    assert got.source == "table" and got.flops == 756 * T and "datasheet" in got.detail
    peak._MEASURED[("cpu", None, "fp32", torch.get_num_threads())] = 7e10
    got = resolve_peak_flops("cpu", torch.float32)
    assert got.source == "measured" and got.flops == 7e10
    assert resolve_peak_flops("cpu", "fp64", measure=False) is None
