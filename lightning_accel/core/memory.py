"""How much memory the model states need per device under ZeRO stages 0-3, with optional CPU/NVMe offload.

The ZeRO paper's formulas (Rajbhandari et al. 2020, §3.1), with offload, frozen parameters and an activation term;
it reproduces the paper's Figure 1 (``tests/core/test_memory.py``). Bytes are plain bytes. The formulas and what is
not modelled: ``docs/techniques/zero.md``, "How the estimate counts".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

__all__ = ["ZERO_CONFIGS", "ZeroMemoryEstimate", "count_model_params", "estimate_zero_memory", "zero_memory_table"]

OffloadDevice = Literal["cpu", "nvme"]

#: The configurations :func:`zero_memory_table` lists, in the order to try them: cheapest in communication and
#: host traffic first. The order follows Hugging Face's DeepSpeed guide ("How to choose which ZeRO stage and
#: offloads to use for best performance": stage 0 → 1 → 2 → 2 + offload optimizer → 3 → 3 + offload
#: optimizer → 3 + offload optimizer and parameters → NVMe).
ZERO_CONFIGS: tuple[tuple[int, OffloadDevice | None, OffloadDevice | None], ...] = (
    (0, None, None),
    (1, None, None),
    (2, None, None),
    (2, "cpu", None),
    (3, None, None),
    (3, "cpu", None),
    (3, "cpu", "cpu"),
    (3, "nvme", "nvme"),
)


@dataclass(frozen=True)
class ZeroMemoryEstimate:
    """Model-state memory of one data-parallel rank under one ZeRO configuration (all sizes in bytes).

    ``device_*`` fields are on the accelerator, ``host_*`` in CPU memory of that rank's process, ``nvme_*`` on the
    NVMe path; ``*_total`` properties sum a location's parts.
    """

    stage: int
    num_params: int
    num_frozen_params: int
    num_devices: int
    offload_optimizer: OffloadDevice | None
    offload_params: OffloadDevice | None
    device_params: float
    device_grads: float
    device_optimizer: float
    device_activations: float
    host_params: float
    host_grads: float
    host_optimizer: float
    nvme_params: float
    nvme_grads: float
    nvme_optimizer: float

    @property
    def device_total(self) -> float:
        """Bytes on each device: parameters + gradients + optimizer states + activations."""
        return self.device_params + self.device_grads + self.device_optimizer + self.device_activations

    @property
    def host_total(self) -> float:
        """Bytes in CPU memory per rank for offloaded states (multiply by ranks per node for a node's RAM)."""
        return self.host_params + self.host_grads + self.host_optimizer

    @property
    def nvme_total(self) -> float:
        """Bytes on the NVMe path per rank."""
        return self.nvme_params + self.nvme_grads + self.nvme_optimizer

    @property
    def label(self) -> str:
        """Short name, e.g. ``"ZeRO-3 + offload opt:cpu params:cpu"``."""
        name = "DDP (stage 0)" if self.stage == 0 else f"ZeRO-{self.stage}"
        parts = []
        if self.offload_optimizer:
            parts.append(f"opt:{self.offload_optimizer}")
        if self.offload_params:
            parts.append(f"params:{self.offload_params}")
        return f"{name} + offload {' '.join(parts)}" if parts else name

    def as_dict(self) -> dict[str, Any]:
        """All fields plus the totals, for logging or JSON."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out.update(
            device_total=self.device_total, host_total=self.host_total, nvme_total=self.nvme_total, label=self.label
        )
        return out


def _check_count(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < minimum:
        raise ValueError(f"estimate_zero_memory({name}={value!r}): use an integer >= {minimum}")
    return int(value)


def _check_bytes(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"estimate_zero_memory({name}={value!r}): use a number of bytes >= 0")
    return float(value)


def _check_offload(name: str, value: Any) -> OffloadDevice | None:
    if value in (None, False, "none"):
        return None
    if value is True:
        return "cpu"
    if value not in ("cpu", "nvme"):
        raise ValueError(f"estimate_zero_memory({name}={value!r}): use None, 'cpu' or 'nvme'")
    return cast(OffloadDevice, value)


def estimate_zero_memory(
    num_params: float,
    num_devices: int,
    stage: int,
    *,
    offload_optimizer: OffloadDevice | bool | None = None,
    offload_params: OffloadDevice | bool | None = None,
    optimizer_bytes_per_param: float = 12,
    param_bytes: float = 2,
    grad_bytes: float = 2,
    num_frozen_params: float = 0,
    activation_bytes_per_sample: float = 0,
    micro_batch_size: int = 0,
) -> ZeroMemoryEstimate:
    """Per-device (and host/NVMe) bytes of model states for ZeRO ``stage`` on ``num_devices`` data-parallel ranks.

    Args:
        num_params: trainable parameters Ψ (``7.5e9`` is accepted).
        num_devices: data-parallel ranks N_d sharing the states.
        stage: ZeRO stage 0 (plain data parallel), 1, 2 or 3.
        offload_optimizer: ``"cpu"`` or ``"nvme"`` to offload optimizer states and their gradient shard (stage >= 1;
            ``True`` means ``"cpu"``).
        offload_params: ``"cpu"`` or ``"nvme"`` to offload the parameter shard (stage 3 only).
        optimizer_bytes_per_param: K, optimizer-state bytes per trainable parameter. 12 = mixed-precision Adam
            (fp32 master copy 4 + momentum 4 + variance 4; ZeRO paper §3.1). Use 8 for pure fp32 Adam (momentum +
            variance; with ``param_bytes=grad_bytes=4``), 4 for mixed-precision SGD without momentum (master copy).
        param_bytes: bytes per parameter the device computes with (2 for fp16/bf16, 4 for fp32).
        grad_bytes: bytes per gradient element (2 for fp16/bf16, 4 for fp32).
        num_frozen_params: parameters without gradients (``param_bytes`` each, no optimizer state).
        activation_bytes_per_sample: activation bytes one sample keeps for backward (measure it, or see
            Korthikanti et al. 2022 for transformers); added to the device as ``× micro_batch_size``.
        micro_batch_size: samples per device per forward.

    Returns:
        A :class:`ZeroMemoryEstimate` with the parts per location; ``.device_total`` is the per-device figure of
        the ZeRO paper's Figure 1.

    Raises:
        ValueError: on a negative or non-integer count, an unknown stage, or an offload the stage does not allow.
    """
    psi = _check_count("num_params", num_params, minimum=0)
    frozen = _check_count("num_frozen_params", num_frozen_params, minimum=0)
    nd = _check_count("num_devices", num_devices, minimum=1)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"estimate_zero_memory(stage={stage!r}): ZeRO stages are 0, 1, 2 and 3")
    k = _check_bytes("optimizer_bytes_per_param", optimizer_bytes_per_param)
    p = _check_bytes("param_bytes", param_bytes)
    g = _check_bytes("grad_bytes", grad_bytes)
    act = _check_bytes("activation_bytes_per_sample", activation_bytes_per_sample)
    mbs = _check_count("micro_batch_size", micro_batch_size, minimum=0)
    off_opt = _check_offload("offload_optimizer", offload_optimizer)
    off_par = _check_offload("offload_params", offload_params)
    if off_opt and stage == 0:
        raise ValueError(
            "estimate_zero_memory: offload_optimizer needs ZeRO stage >= 1 (stage 0 has no optimizer "
            "partition to offload); use stage=1, 2 or 3"
        )
    if off_par and stage != 3:
        raise ValueError(
            f"estimate_zero_memory: offload_params needs ZeRO stage 3 (got stage={stage}): only "
            "stage 3 partitions the parameters"
        )

    # ZeRO paper §3.1 / Figure 1: what each stage shards across the N_d ranks.
    params = p * (psi + frozen) / (nd if stage >= 3 else 1)
    grads = g * psi / (nd if stage >= 2 else 1)
    optim = k * psi / (nd if stage >= 1 else 1)

    where = {"device": [params, grads, optim], "cpu": [0.0, 0.0, 0.0], "nvme": [0.0, 0.0, 0.0]}
    if off_opt:
        # ZeRO-Offload §4.1: the optimizer step runs where its states are, on the gradient shard streamed there.
        where["device"][2] = 0.0
        where[off_opt][2] = optim
        where[off_opt][1] = g * psi / nd
        if stage >= 2:
            where["device"][1] = 0.0
    if off_par:
        where["device"][0] = 0.0
        where[off_par][0] = params
    return ZeroMemoryEstimate(
        stage=stage,
        num_params=psi,
        num_frozen_params=frozen,
        num_devices=nd,
        offload_optimizer=off_opt,
        offload_params=off_par,
        device_params=where["device"][0],
        device_grads=where["device"][1],
        device_optimizer=where["device"][2],
        device_activations=act * mbs,
        host_params=where["cpu"][0],
        host_grads=where["cpu"][1],
        host_optimizer=where["cpu"][2],
        nvme_params=where["nvme"][0],
        nvme_grads=where["nvme"][1],
        nvme_optimizer=where["nvme"][2],
    )


def count_model_params(model: Any) -> tuple[int, int]:
    """(trainable, frozen) parameter counts of a ``torch.nn.Module``; shared (tied) parameters count once.

    ``Module.parameters()`` already yields each ``Parameter`` object once; storages shared by distinct
    ``Parameter`` objects (views of one tensor) are also counted once, by data pointer.
    """
    seen: set[tuple[int, int]] = set()
    trainable = frozen = 0
    for param in model.parameters():
        key = (param.data_ptr(), param.numel()) if param.device.type != "meta" else (id(param), param.numel())
        if key in seen:
            continue
        seen.add(key)
        if param.requires_grad:
            trainable += param.numel()
        else:
            frozen += param.numel()
    return trainable, frozen


def _from_model(model: Any, num_devices: int, stage: int, **kwargs: Any) -> ZeroMemoryEstimate:
    """:func:`estimate_zero_memory` for a ``torch.nn.Module``: trainable and frozen counts taken from ``model``.

    Shared (tied) parameters, e.g. an embedding tied to the output layer, are counted once.
    """
    if "num_params" in kwargs or "num_frozen_params" in kwargs:
        raise ValueError("estimate_zero_memory.from_model counts num_params/num_frozen_params itself; drop them")
    trainable, frozen = count_model_params(model)
    return estimate_zero_memory(trainable, num_devices, stage, num_frozen_params=frozen, **kwargs)


estimate_zero_memory.from_model = _from_model  # type: ignore[attr-defined]


def zero_memory_table(
    num_params: float, num_devices: int, *, include_nvme: bool = True, **kwargs: Any
) -> list[ZeroMemoryEstimate]:
    """:func:`estimate_zero_memory` for every configuration of :data:`ZERO_CONFIGS`, in that order."""
    return [
        estimate_zero_memory(num_params, num_devices, stage, offload_optimizer=opt, offload_params=par, **kwargs)
        for stage, opt, par in ZERO_CONFIGS
        if include_nvme or "nvme" not in (opt, par)
    ]
