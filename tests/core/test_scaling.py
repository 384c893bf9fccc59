"""The α–β projection against values computed by hand."""

from __future__ import annotations

import pytest

from lightning_accel.core.scaling import (
    INTERCONNECTS,
    Interconnect,
    ScalingWorkload,
    allgather_seconds,
    allreduce_seconds,
    fit_interconnect,
    get_interconnect,
    powersgd_compression_ratio,
    project_scaling,
    reduce_scatter_seconds,
    ring_allreduce_seconds,
    scaling_efficiency,
    tree_allreduce_seconds,
)

# round numbers: 1 GB/s, 1 ms per message step
LINK = Interconnect("test", 1e9, 1e-3)


def test_ring_collectives_by_hand():
    # the all-reduce is the faster of ring and tree: 1 GB over 4 ranks is a ring (1.506 s vs tree 2.004 s)
    assert tree_allreduce_seconds(1e9, 4, LINK) == pytest.approx(2 * 2 * 1e-3 + 2.0)
    # 1 KB over 1024 ranks is a tree: 2*10*1 ms vs the ring's 2*1023 ms
    assert allreduce_seconds(1e3, 1024, LINK) == pytest.approx(0.020 + 2e-6)
    assert ring_allreduce_seconds(1e3, 1024, LINK) == pytest.approx(2.046 + 2 * 1023 / 1024 * 1e-6)
    # all-reduce of 1 GB over 4 ranks: 2*3*1 ms + 2*3/4 * 1 s = 0.006 + 1.5
    assert allreduce_seconds(1e9, 4, LINK) == pytest.approx(1.506)
    # all-gather / reduce-scatter: half of it: 3 ms + 0.75 s
    assert allgather_seconds(1e9, 4, LINK) == pytest.approx(0.753)
    assert reduce_scatter_seconds(1e9, 4, LINK) == pytest.approx(0.753)
    # one rank talks to nobody
    assert allreduce_seconds(1e9, 1, LINK) == 0.0 and allgather_seconds(1e9, 1, LINK) == 0.0
    # reduce-scatter + all-gather = all-reduce (the ZeRO paper's 2Ψ for stages 1-2)
    assert reduce_scatter_seconds(5e8, 8, LINK) + allgather_seconds(5e8, 8, LINK) == pytest.approx(
        allreduce_seconds(5e8, 8, LINK)
    )


def test_ddp_overlap_and_last_bucket_by_hand():
    # 100 M fp32 gradients = 400 MB, buckets of 100 MB -> 4 buckets; compute 1 s, backward 2/3 s
    w = ScalingWorkload(compute_s=1.0, params=100_000_000, bucket_bytes=100e6)
    (p,) = project_scaling(w, LINK, n=[2], strategies=["ddp"])
    comm = 4 * 2 * 1 * 1e-3 + 2 * 1 / 2 * 400e6 / 1e9  # 0.008 + 0.4
    assert p.comm_s == pytest.approx(comm)
    # all of it hides behind 2/3 s of backward except the last bucket: 2 ms + 0.1 s
    assert p.exposed_s == pytest.approx(0.102)
    assert p.step_s == pytest.approx(1.102) and p.efficiency == pytest.approx(1 / 1.102)
    (p8,) = project_scaling(w, LINK, n=[8], strategies=["ddp"])
    comm8 = 4 * 2 * 7 * 1e-3 + 2 * 7 / 8 * 0.4  # 0.056 + 0.7 = 0.756: 0.089 s more than backward...
    assert p8.comm_s == pytest.approx(comm8)
    assert p8.exposed_s == pytest.approx(0.014 + 2 * 7 / 8 * 0.1)  # ...but the last bucket alone takes 0.189 s
    small = ScalingWorkload(compute_s=1.0, params=100_000_000, bucket_bytes=25e6)  # 16 buckets
    (p8,) = project_scaling(small, LINK, n=[8], strategies=["ddp"])
    # a 25 MB bucket: ring 14 ms + 43.75 ms, tree 2*3*1 ms + 50 ms -> the tree's 56 ms
    assert tree_allreduce_seconds(25e6, 8, LINK) < ring_allreduce_seconds(25e6, 8, LINK)
    comm8 = 16 * (6e-3 + 0.05)  # 0.896: the excess over backward (0.229 s) beats the last bucket (0.056 s)
    assert p8.comm_s == pytest.approx(comm8)
    assert p8.exposed_s == pytest.approx(comm8 - 2 / 3)


def test_compression_halves_or_divides_the_bytes():
    w = ScalingWorkload(compute_s=0.01, params=100_000_000, bucket_bytes=1e12, powersgd_ratio=50.0)
    ddp, bf16, psgd = project_scaling(w, LINK, n=[16], strategies=["ddp", "ddp_bf16_compress", "ddp_powersgd"])
    # one bucket: ddp = 2*15*1ms + 2*15/16*0.4 s; bf16 sends 0.2 GB; PowerSGD 8 MB with 2 all-reduces' latency
    assert ddp.comm_s == pytest.approx(0.030 + 0.75)
    assert bf16.comm_s == pytest.approx(0.030 + 0.375)
    # PowerSGD: P and Q, 4 MB each: the tree (2*4 ms + 8 ms) beats the ring (30 ms + 7.5 ms)
    assert psgd.comm_s == pytest.approx(2 * (2 * 4 * 1e-3 + 2 * 4e6 / 1e9))
    # a single bucket is ready only when backward ends: none of it hides
    assert ddp.exposed_s == pytest.approx(ddp.comm_s)


def test_zero_volumes_follow_the_zero_paper():
    # 2Ψ for stages 1-2 (reduce-scatter + all-gather), 3Ψ for stage 3 (all-gather twice)
    w = ScalingWorkload(compute_s=1.0, params=250_000_000, bucket_bytes=1e12)  # 1 GB fp32 grads and params
    z1, z2, z3 = project_scaling(w, LINK, n=[4], strategies=["zero1", "zero2", "zero3"])
    ag = rs = 0.753
    assert z1.comm_s == pytest.approx(rs + ag) == pytest.approx(z2.comm_s)
    assert z3.comm_s == pytest.approx(rs + 2 * ag)
    # stage 1-2: reduce-scatter hides behind backward (2/3 s) except what exceeds it; all-gather after the step
    assert z2.exposed_s == pytest.approx(max(rs - 2 / 3, rs) + ag)  # one bucket: the whole rs is the last bucket
    # stage 3 (one unit): forward all-gather behind 1/3 s of forward, backward all-gather + reduce-scatter behind
    # 2/3 s, at least the last unit's reduce-scatter
    assert z3.exposed_s == pytest.approx((ag - 1 / 3) + max(rs, ag + rs - 2 / 3))
    # 10 units (blocks): 10 collectives of a tenth each: 9 more latencies, the same bytes; the last is a tenth
    (z3u,) = project_scaling(
        ScalingWorkload(compute_s=1.0, params=250_000_000, units=10), LINK, n=[4], strategies=["zero3"]
    )
    ag10 = rs10 = 0.753 + 9 * 3 * 1e-3
    assert z3u.comm_s == pytest.approx(2 * ag10 + rs10)
    assert z3u.exposed_s == pytest.approx((ag10 - 1 / 3) + max(3e-3 + 0.075, ag10 + rs10 - 2 / 3))
    # stage 1-2 reduce-scatter in buckets: 4 buckets of 250 MB -> 3 more latencies
    (z2b,) = project_scaling(
        ScalingWorkload(compute_s=1.0, params=250_000_000, bucket_bytes=250e6), LINK, n=[4], strategies=["zero2"]
    )
    assert z2b.comm_s == pytest.approx(rs + 3 * 3e-3 + ag)


def test_tensor_parallel_times_data_parallel_by_hand():
    nvlink = Interconnect("fast", 100e9, 1e-5)
    w = ScalingWorkload(
        compute_s=0.8,
        params=80_000_000,
        bucket_bytes=1e12,
        n_layers=2,
        hidden_size=1000,
        tokens_per_step=5000,
        activation_bytes=2,
    )
    (p,) = project_scaling(w, LINK, n=[16], strategies=["tp"], tp_size=8, tp_interconnect=nvlink)
    act = 5000 * 1000 * 2  # 10 MB per all-reduce
    tp = 4 * 2 * (2 * 3 * 1e-5 + 2 * act / 100e9)  # the tree (0.26 ms) beats the ring (0.315 ms) at 10 MB
    dp = 2 * 1 * 1e-3 + 2 * 1 / 2 * (80e6 * 4 / 8) / 1e9  # 40 MB of gradients per TP rank over 2 replicas
    assert p.tp_size == 8 and p.compute_s == pytest.approx(0.1)
    assert p.comm_s == pytest.approx(tp + dp)
    assert p.exposed_s == pytest.approx(tp + dp)  # one bucket: the last bucket is all of it
    assert p.efficiency == pytest.approx(0.8 / (8 * (0.1 + tp + dp)))
    # n smaller than the TP size: the whole group is TP
    (small,) = project_scaling(w, LINK, n=[4], strategies=["tp"], tp_size=8, tp_interconnect=nvlink)
    assert small.tp_size == 4
    with pytest.raises(ValueError, match="tp_size=8 does not divide n=12"):
        project_scaling(w, LINK, n=[12], strategies=["tp"], tp_size=8)


def test_efficiency_falls_with_n_and_one_device_is_perfect():
    w = ScalingWorkload(compute_s=0.2, params=350_000_000)
    points = project_scaling(w, "infiniband_ndr", n=[1, 2, 8, 64, 512], strategies=["ddp"])
    assert points[0].efficiency == 1.0 and points[0].exposed_s == 0.0
    effs = [p.efficiency for p in points]
    assert effs == sorted(effs, reverse=True) and effs[-1] < effs[1]
    assert points[2].speedup == pytest.approx(8 * points[2].efficiency)


def test_powersgd_ratio_follows_torch_rules():
    # 1024x1024 matrix at rank 1: 2048 sent of 1,048,576 (512x); a 1024 bias stays; 4x4 does not shrink 2x
    ratio = powersgd_compression_ratio([(1024, 1024), (1024,), (4, 4)])
    assert ratio == pytest.approx((1024 * 1024 + 1024 + 16) / (2048 + 1024 + 16))
    # conv weight viewed as out x (in*k*k)
    assert powersgd_compression_ratio([(64, 32, 3, 3)], rank=2) == pytest.approx(64 * 288 / (2 * (64 + 288)))


def test_fit_interconnect_recovers_alpha_beta():
    link = Interconnect("truth", 2e9, 4e-5)
    sizes = [1e3, 1e6, 1e7, 1e8]
    times = [allreduce_seconds(s, 2, link) for s in sizes]
    fitted = fit_interconnect(sizes, times, 2)
    assert fitted.bandwidth == pytest.approx(2e9) and fitted.latency == pytest.approx(4e-5)


def test_scaling_efficiency():
    assert scaling_efficiency(100.0, 180.0, 2) == pytest.approx(0.9)


def test_bad_input_names_the_value_and_the_fix():
    with pytest.raises(ValueError, match="unknown interconnect 'myrinet'.*nvlink, infiniband_ndr, 100gbe, 25gbe"):
        get_interconnect("myrinet")
    assert get_interconnect("InfiniBand-NDR") is INTERCONNECTS["infiniband_ndr"]
    w = ScalingWorkload(compute_s=0.1, params=1000)
    for bad in (0, -4):
        with pytest.raises(ValueError, match=f"n={bad}.*integer >= 1"):
            project_scaling(w, "nvlink", n=[bad])
    with pytest.raises(ValueError, match="unknown strategy 'fsdp9'"):
        project_scaling(w, "nvlink", strategies=["fsdp9"])
    with pytest.raises(ValueError, match="'tp' needs the workload's n_layers"):
        project_scaling(w, "nvlink", strategies=["tp"])
    with pytest.raises(ValueError, match="compute_s=0"):
        ScalingWorkload(compute_s=0, params=10)
    with pytest.raises(ValueError, match="bandwidth=-1"):
        Interconnect("x", -1, 0)


def test_topk_and_qsgd_are_all_gathers_that_pay_on_few_ranks_over_slow_links_and_lose_at_scale():
    from lightning_accel.core.scaling import ScalingWorkload, allgather_seconds, get_interconnect, project_scaling

    w = ScalingWorkload(compute_s=0.3, params=100_000_000, bucket_bytes=4e8)  # one bucket: exact arithmetic
    link = get_interconnect("25gbe")
    by = {
        (p.strategy, p.n): p
        for p in project_scaling(w, link, n=(2, 8, 512), strategies=("ddp", "ddp_topk", "ddp_qsgd"))
    }
    # Top-K: each rank contributes 8 bytes per kept entry (fp32 value + int32 index), the all-gather delivers N of them
    assert by["ddp_topk", 8].comm_s == pytest.approx(allgather_seconds(8 * 0.01 * 1e8 * 8, 8, link))
    # QSGD: 4 bits + one fp32 norm per 128 entries, per rank
    assert by["ddp_qsgd", 8].comm_s == pytest.approx(allgather_seconds(8 * 1e8 * (0.5 + 4 / 128), 8, link))
    for strategy, fewer in (("ddp_topk", 40), ("ddp_qsgd", 7)):
        assert by[strategy, 2].comm_s < by["ddp", 2].comm_s / fewer  # few ranks: far fewer bytes
        assert by[strategy, 512].comm_s > by["ddp", 512].comm_s  # all-gather bytes grow with N: a loss at scale
