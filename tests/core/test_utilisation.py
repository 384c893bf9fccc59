from types import SimpleNamespace

import pytest

from lightning_accel.core.utilisation import CpuUtilisation, GpuUtilisation, usable_cpu_count


class FakeProc:
    def __init__(self, cpu, children=()):
        self.cpu, self._children, self.pid = cpu, list(children), 1

    def cpu_times(self):
        return SimpleNamespace(user=self.cpu, system=0.0)

    def create_time(self):
        return 100.0 + self.pid

    def children(self, recursive=True):
        return self._children


def test_cpu_utilisation_counts_process_and_workers_per_window():
    clock = SimpleNamespace(t=0.0)
    worker = FakeProc(1.0)
    worker.pid = 7
    proc = FakeProc(10.0, [worker])
    cpu = CpuUtilisation(process=proc, clock=lambda: clock.t)
    assert cpu.sample() is None  # not started
    cpu.start()
    clock.t, proc.cpu, worker.cpu = 2.0, 11.0, 2.5  # 1 s own, 1.5 s worker CPU in 2 s wall
    newborn = FakeProc(0.4)
    newborn.pid = 8
    proc._children.append(newborn)  # a worker started inside the window: all of its 0.4 s count
    out = cpu.sample()
    assert out["cpu_process_pct"] == pytest.approx(50.0)
    assert out["cpu_workers_pct"] == pytest.approx(95.0)
    assert usable_cpu_count() >= 1


class FakeNvml:
    NVML_GPU_UTILIZATION_SAMPLES = 1
    NVML_CLOCK_SM = 1

    def __init__(self, samples):
        self.samples = samples

    def nvmlInit(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetSamples(self, handle, kind, since):
        return 0, [s for s in self.samples if s.timeStamp > since]

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=42)

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=20, total=80)

    def nvmlDeviceGetClockInfo(self, handle, kind):
        return 1980


def sample(ts, v):
    return SimpleNamespace(timeStamp=ts, sampleValue=SimpleNamespace(uiVal=v))


def test_gpu_utilisation_averages_the_windows_samples():
    nvml = FakeNvml([sample(1, 10), sample(2, 20)])
    gpu = GpuUtilisation(0, nvml=nvml)
    gpu.start()  # samples up to timestamp 2 belong to earlier windows
    nvml.samples += [sample(3, 80), sample(4, 100)]
    out = gpu.sample()
    assert out == {"gpu_util_pct": 90.0, "gpu_mem_used_frac": 0.25, "gpu_sm_clock_mhz": 1980.0}
    assert gpu.sample()["gpu_util_pct"] == 42.0  # no new sample: the instantaneous reading
