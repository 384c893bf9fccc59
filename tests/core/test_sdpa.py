import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from lightning_accel.core.sdpa import SdpaBackendProbe


def attention(q):
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()


def test_probe_sees_the_fused_cpu_kernel_and_the_math_fallback():
    q = torch.randn(2, 2, 8, 4, requires_grad=True)
    with SdpaBackendProbe() as probe:
        attention(q)
    assert probe.backend == "flash"
    with sdpa_kernel(SDPBackend.MATH), SdpaBackendProbe() as probe:
        attention(q)
    assert probe.backend == "math" and probe.calls["math"] == 1


def test_probe_without_attention():
    with SdpaBackendProbe() as probe:
        torch.nn.Linear(3, 3)(torch.randn(2, 3)).sum().backward()
    assert probe.backend is None
