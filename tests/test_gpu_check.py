"""benchmarks/gpu_check.py must not rot between GPU machines: its --smoke mode runs every check at tiny sizes on
the CPU (the GPU-marked tests and nvJPEG decode excepted)."""

import importlib.util

from tests.conftest import REPO


def test_gpu_check_smoke_runs_every_check_without_error():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    rows = gpu_check.main(["--smoke"])
    names = [r[0] for r in rows]
    assert "GPT MFU" in names and "stage timer vs sync reference" in names
    from lightning_accel._imports import is_available

    if is_available("nvidia.dali"):  # without the dali extra the data check reports that instead
        assert "data: PyTorch DataLoader + PIL" in names and "data: DALIImageDataModule (CPU, ROI decode)" in names
    assert "autopilot" in names and "autopilot training" in names and "autopilot precision" in names
    assert "attribution 32-true" in names and "attribution bf16-mixed vs host clock" in names
    assert "channels_last finding (bf16 CNN)" in names and "channels_last speed-up (bf16 CNN, A B x3)" in names
    assert "GPT-350M MFU (bf16, compile, SDPA, fused AdamW, fused CE)" in names
    if is_available("torchao"):  # without the torchao extra the FP8 check says it is skipped
        assert "FP8 vs bf16 tokens/s (both compiled)" in names and "FP8 vs bf16 loss (mean of the last tenth)" in names
    assert "fused CE peak memory" in names and "compile cold start: whole vs regions" in names
    assert "TF32 speed-up after a warm-up (3 pairs)" in names
    assert not [r for r in rows if r[1] == "ERROR"], rows
