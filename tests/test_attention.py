"""Attention fast paths: backend choice and errors, the backend recorder, MHA and hand-written blocks fused."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_accel import SDPABackendRecorder, sdpa_backends, use_fused_attention
from lightning_accel.attention import available_sdpa_backends

D, H, T, B = 16, 2, 6, 3


def qkv(requires_grad=False):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(B, H, T, D // H, generator=g, requires_grad=requires_grad) for _ in range(3)]


# --- sdpa_backends -------------------------------------------------------------------------------------------------


def test_cpu_backends_and_choice_is_what_runs():
    assert available_sdpa_backends("cpu") == ("flash", "math")
    q, k, v = qkv()
    with sdpa_backends("math", device="cpu"), SDPABackendRecorder() as rec:
        math_out = F.scaled_dot_product_attention(q, k, v)
    assert rec.counts == {"flash": 0, "efficient": 0, "cudnn": 0, "math": 1} and rec.math_fallback
    with sdpa_backends(forbid="math", device="cpu") as chosen, SDPABackendRecorder() as rec:
        flash_out = F.scaled_dot_product_attention(q, k, v)
    assert chosen.backends == ("flash",)
    assert rec.counts == {"flash": 1, "efficient": 0, "cudnn": 0, "math": 0} and not rec.math_fallback
    torch.testing.assert_close(flash_out, math_out)


def test_decorator_form():
    @sdpa_backends("math", device="cpu")
    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v)

    with SDPABackendRecorder() as rec:
        attend(*qkv())
        F.scaled_dot_product_attention(*qkv())  # outside the decorated function: the default choice again
    assert rec.counts["math"] == 1 and rec.counts["flash"] == 1 and rec.calls == 2


def test_unavailable_unknown_or_empty_choice_errors():
    with pytest.raises(ValueError, match=r"cudnn not available on cpu.*available there: flash, math"):
        sdpa_backends("cudnn", device="cpu")
    with pytest.raises(ValueError, match="unknown backend 'flash2'"):
        sdpa_backends("flash2")
    with pytest.raises(ValueError, match="no backend left"):
        sdpa_backends("math", forbid=["math"], device="cpu")


@pytest.mark.parametrize(
    "capability, cudnn, expected",
    [
        ((7, 5), 90100, ("efficient", "math")),  # T4: no flash, no cuDNN attention
        ((8, 0), 90100, ("flash", "efficient", "cudnn", "math")),  # A100
        ((9, 0), 8907, ("flash", "efficient", "math")),  # H100 with cuDNN 8: no cuDNN attention
    ],
)
def test_cuda_backends_by_capability(monkeypatch, capability, cudnn, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn)
    monkeypatch.setattr(torch.version, "hip", None)
    assert available_sdpa_backends("cuda:0") == expected
    if "flash" not in expected:
        with pytest.raises(
            ValueError,
            match=rf"flash not available on cuda:0 \(Fake GPU, sm{capability[0]}"
            rf"{capability[1]}\); available there: {', '.join(expected)}",
        ):
            sdpa_backends("flash", device="cuda:0")


# --- recorder on modules -------------------------------------------------------------------------------------------


def test_recorder_names_mha_need_weights_as_math_and_restores_functional():
    mha = nn.MultiheadAttention(D, H, batch_first=True)
    x = torch.randn(B, T, D)
    original = F.scaled_dot_product_attention, F.multi_head_attention_forward
    with SDPABackendRecorder() as rec:
        mha(x, x, x)  # need_weights=True by default: explicit bmm + softmax
        mha(x, x, x, need_weights=False)  # SDPA
    assert rec.counts == {"flash": 1, "efficient": 0, "cudnn": 0, "math": 1} and rec.calls == 2
    assert (F.scaled_dot_product_attention, F.multi_head_attention_forward) == original


# --- nn.MultiheadAttention -----------------------------------------------------------------------------------------


class MHAModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.unused = nn.MultiheadAttention(D, H, batch_first=True)
        self.used = nn.MultiheadAttention(D, H, batch_first=True)
        self.stored = nn.MultiheadAttention(D, H, batch_first=True)
        self.norm = nn.BatchNorm1d(T)
        self.last_weights = None

    def forward(self, x):
        x = self.norm(x)
        a, _ = self.unused(x, x, x)
        b, w = self.used(a, a, a)
        c, self.last_weights = self.stored(b, b, b)  # kept for later inspection: counts as used
        return c + w.mean()


def test_mha_unused_weights_switched_same_forward_and_gradients():
    torch.manual_seed(0)
    model = MHAModel()
    x = torch.randn(B, T, D, requires_grad=True)
    ref = model(x)
    ref.square().sum().backward()
    ref_grads = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad()
    x.grad = None
    running_mean = model.norm.running_mean.clone()
    rng = torch.get_rng_state()

    result = use_fused_attention(model, example_inputs=x.detach())
    assert result.mha == ["unused"] and sorted(result.kept) == ["stored", "used"]
    assert torch.equal(model.norm.running_mean, running_mean) and torch.equal(torch.get_rng_state(), rng)

    model.norm.running_mean.copy_(running_mean)
    with SDPABackendRecorder() as rec:
        out = model(x)
    assert rec.counts["flash"] == 1 and rec.counts["math"] == 2  # one switched, two kept on the explicit path
    out.square().sum().backward()
    torch.testing.assert_close(out, ref)
    for got, want in zip([p.grad for p in model.parameters()] + [x.grad], ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert model.unused(x, x, x)[1] is None  # weights no longer computed
    result.restore()
    assert model.unused(x, x, x)[1] is not None


def test_mha_without_example_only_named_modules_positional_need_weights():
    model = MHAModel()
    result = use_fused_attention(model, blocks=["used"])
    assert result.mha == ["used"] and result.blocks == []
    x = torch.randn(B, T, D)
    out, weights = model.used(x, x, x, None, True)  # need_weights passed positionally
    assert weights is None and out.shape == (B, T, D)


def test_model_without_attention_warns_and_is_unchanged():
    model = nn.Sequential(nn.Linear(D, D), nn.ReLU())
    x = torch.randn(2, D)
    before = model(x)
    with pytest.warns(UserWarning, match="nothing to change.*model is unchanged"):
        result = use_fused_attention(model, example_inputs=x)
    assert result.mha == result.blocks == [] and not model[0]._forward_hooks and not model._forward_pre_hooks
    torch.testing.assert_close(model(x), before)
    with pytest.warns(UserWarning, match="name hand-written attention modules"):
        use_fused_attention(model)


def test_unknown_block_name():
    with pytest.raises(ValueError, match=r"\['attn'\] not found in the model"):
        use_fused_attention(nn.Sequential(nn.Linear(2, 2)), blocks=["attn"])


# --- hand-written attention ----------------------------------------------------------------------------------------


class HandWritten(nn.Module):
    """nanoGPT-style attention; ``variant`` picks how the scores are scaled and masked."""

    def __init__(self, variant="mul_masked_fill", dropout=0.0, expose=False):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.drop = nn.Dropout(dropout)
        self.variant, self.expose = variant, expose
        self.register_buffer("causal", torch.triu(torch.ones(T, T, dtype=torch.bool), 1))
        self.last_probs = None

    def forward(self, x, additive_mask=None):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, H, d // H).transpose(1, 2) for z in (q, k, v))
        if self.variant == "mul_masked_fill":
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.causal[:t, :t], float("-inf"))
        elif self.variant == "div_additive":
            att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(k.shape[-1]) + additive_mask
        else:  # "unscaled_bmm": 3-d, no scale, no mask
            q, k, v = (z.reshape(b * H, t, d // H) for z in (q, k, v))
            att = torch.bmm(q, k.transpose(1, 2))
        att = F.softmax(att, dim=-1)
        att = self.drop(att)
        if self.expose:
            self.last_probs = att
        y = att @ v
        y = y.reshape(b, H, t, d // H).transpose(1, 2).reshape(b, t, d)
        return self.proj(y)


class Net(nn.Module):
    def __init__(self, **block_kwargs):
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.attn = HandWritten(**block_kwargs)

    def forward(self, x, additive_mask=None):
        return self.attn(self.embed(x), additive_mask)


def run(model, x, mask=None):
    x = x.detach().clone().requires_grad_(True)
    model.zero_grad()
    out = model(x, mask)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


@pytest.mark.parametrize("variant", ["mul_masked_fill", "div_additive", "unscaled_bmm"])
def test_hand_written_block_fused_same_forward_and_gradients(variant):
    torch.manual_seed(0)
    model = Net(variant=variant)
    x = torch.randn(B, T, D)
    mask = torch.randn(T, T) if variant == "div_additive" else None
    ref_out, ref_grads = run(model, x, mask)
    result = use_fused_attention(model, blocks=["attn"])
    with SDPABackendRecorder() as rec:
        out, grads = run(model, x, mask)
    assert result.fused_calls == {"attn": 1} and rec.calls == 1 and rec.counts["math"] == 0
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_hand_written_eval_dropout_is_fused_training_dropout_is_not():
    torch.manual_seed(0)
    model = Net(dropout=0.5)
    x = torch.randn(B, T, D)
    result = use_fused_attention(model, blocks=["attn"])
    model.eval()
    with torch.no_grad():
        model(x)
    assert result.fused_calls["attn"] == 1
    model.train()
    result.restore()
    torch.manual_seed(1)
    ref_out, ref_grads = run(model, x)
    result = use_fused_attention(model, blocks=["attn"])
    torch.manual_seed(1)
    with pytest.warns(UserWarning, match=r"'attn' \(HandWritten\) did not fire.*dropout\(p=0.5\) in training mode"):
        out, grads = run(model, x)  # dropout p=0.5 in training: the original ops, same RNG draws, same numbers
    assert result.fused_calls["attn"] == 0 and "dropout(p=0.5)" in result.not_fired["attn"]
    assert torch.equal(out, ref_out) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_hand_written_probs_used_elsewhere_runs_the_original_exactly():
    torch.manual_seed(0)
    model = Net(expose=True)
    x = torch.randn(B, T, D)
    ref_out, ref_grads = run(model, x)
    ref_probs = model.attn.last_probs.detach().clone()
    result = use_fused_attention(model, blocks=["attn"])
    out, grads = run(model, x)
    # the probabilities are stored: the final matmul still fuses, the stored placeholder computes on first use
    probs = model.attn.last_probs
    assert torch.equal(probs + 0, ref_probs)
    assert result.fused_calls["attn"] == 1
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_hand_written_scores_read_inside_block_materialise():
    class Peeking(HandWritten):
        def forward(self, x, additive_mask=None):
            b, t, d = x.shape
            q, k, v = (z.view(b, t, H, d // H).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
            scores = q @ k.transpose(-2, -1)
            self.max_score = scores.max()  # any other use: the original matmul runs
            y = F.softmax(scores, dim=-1) @ v
            return self.proj(y.transpose(1, 2).reshape(b, t, d)), scores

    torch.manual_seed(0)
    block = Peeking()
    x = torch.randn(B, T, D)
    ref_y, ref_scores = block(x)
    result = use_fused_attention(block, blocks=[""])
    with pytest.warns(UserWarning, match="did not fire in its forward: max on the scores"):
        y, scores = block(x)
    assert result.fused_calls[""] == 0
    assert type(scores) is torch.Tensor  # nothing lazy leaves the block
    assert torch.equal(y, ref_y) and torch.equal(scores, ref_scores)


# --- real GPU ------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_flash_and_fused_mha():
    q, k, v = (t.cuda().half() for t in qkv())
    assert "flash" in available_sdpa_backends("cuda") or "efficient" in available_sdpa_backends("cuda")
    fused = [name for name in ("flash", "efficient") if name in available_sdpa_backends("cuda")]
    with sdpa_backends(*fused), SDPABackendRecorder() as rec:
        out = F.scaled_dot_product_attention(q, k, v)
    assert rec.counts["math"] == 0 and sum(rec.counts[n] for n in fused) == 1
    with sdpa_backends("math"):
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=2e-3, atol=2e-3)
    model = Net().cuda().half()
    x = torch.randn(B, T, D, device="cuda", dtype=torch.half)
    ref = model(x)
    use_fused_attention(model, blocks=["attn"])
    with SDPABackendRecorder() as rec:
        out = model(x)
    assert rec.counts["math"] == 0
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)


def test_recorder_backend_names_the_kernel_that_ran():
    """What BottleneckDoctor's attention rule reads: the CPU flash kernel, the math fallback, or no attention."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_accel.attention import SDPABackendRecorder

    q = torch.randn(2, 2, 8, 4, requires_grad=True)
    with SDPABackendRecorder() as rec:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    assert rec.backend == "flash"
    with sdpa_kernel(SDPBackend.MATH), SDPABackendRecorder() as rec:
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    assert rec.backend == "math" and rec.counts["math"] == 1
    with SDPABackendRecorder() as rec:
        torch.nn.Linear(3, 3)(torch.randn(2, 3)).sum().backward()
    assert rec.backend is None


# --- the hand-written patterns real libraries use -------------------------------------------------------------------


class LibraryStyle(nn.Module):
    """Attention written as Hugging Face eager (Llama, GPT-2), timm and nanoGPT write it; returns (out, weights)."""

    def __init__(self, variant):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.drop = nn.Dropout(0.0)
        self.variant = variant
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))  # nanoGPT's causal buffer

    def forward(self, x, mask=None):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, H, d // H).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        scale = (d // H) ** -0.5
        if self.variant == "hf_llama":  # softmax in fp32, cast back with .to(query.dtype), functional dropout
            w = torch.matmul(q, k.transpose(2, 3)) * scale + mask
            w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
            w = F.dropout(w, p=0.0, training=self.training)
        elif self.variant == "hf_gpt2":  # .type(value.dtype) between softmax and dropout
            w = torch.matmul(q, k.transpose(-1, -2)) * scale + mask
            w = F.softmax(w, dim=-1).type(v.dtype)
            w = F.dropout(w, p=0.0, training=self.training)
        elif self.variant == "hf_gpt2_5_0":  # transformers 5.0: / a 0-dim tensor, torch.where(causal, w, min)
            w = torch.matmul(q, k.transpose(-1, -2))
            w = w / torch.full([], v.size(-1) ** 0.5, dtype=w.dtype, device=w.device)
            causal = self.bias[:, :, :t, :t].bool()
            low = torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device)
            w = torch.where(causal, w.to(w.dtype), low) + mask
            w = F.softmax(w, dim=-1).type(v.dtype)
            w = self.drop(w)
        elif self.variant == "timm":  # query pre-scaled before the matmul, Tensor.softmax, dropout module
            q = q * scale
            w = (q @ k.transpose(-2, -1)).softmax(dim=-1)
            w = self.drop(w)
        elif self.variant == "nanogpt":  # causal buffer == 0 through masked_fill(-inf)
            w = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            w = w.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            w = self.drop(F.softmax(w, dim=-1))
        elif self.variant == "finfo_min_and_padding":  # lowest finite value, then an additive padding mask
            w = (q @ k.transpose(-2, -1)) * scale
            w = w.masked_fill(self.bias[:, :, :t, :t] == 0, torch.finfo(w.dtype).min) + mask
            w = F.softmax(w, dim=-1)
        y = (w @ v).transpose(1, 2).reshape(b, t, d)
        return self.proj(y), w


def padding_mask(dtype=torch.float32):
    """Additive mask (B, 1, 1, T): the last two keys of sample 0 padded, as Hugging Face builds it."""
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[0, -2:] = False
    return torch.zeros(B, 1, 1, T, dtype=dtype).masked_fill(~keep[:, None, None, :], torch.finfo(dtype).min)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("variant", ["hf_llama", "hf_gpt2", "hf_gpt2_5_0", "timm", "nanogpt", "finfo_min_and_padding"])
def test_library_patterns_fused_same_results(variant, mode):
    torch.manual_seed(0)
    block = LibraryStyle(variant).train(mode == "train")
    x = torch.randn(B, T, D)
    mask = padding_mask()

    def step():
        xx = x.detach().clone().requires_grad_(True)
        block.zero_grad()
        out, weights = block(xx, mask)
        out.square().sum().backward()
        return out.detach(), weights, [p.grad.clone() for p in block.parameters()] + [xx.grad.clone()]

    ref_out, ref_weights, ref_grads = step()
    result = use_fused_attention(block, blocks=[""])
    with SDPABackendRecorder() as rec:
        out, weights, grads = step()
        out2, _, _ = step()
    assert result.fused_calls == {"": 2} and rec.calls == 2 and result.not_fired == {}
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out2, ref_out, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # the returned weights stay a placeholder (nothing computed them); on use they are the original's
    assert type(weights) is not torch.Tensor
    torch.testing.assert_close(weights + 0, ref_weights.detach(), rtol=1e-5, atol=1e-6)


def test_library_pattern_under_cpu_autocast_fused_in_the_autocast_dtype():
    torch.manual_seed(0)
    block = LibraryStyle("hf_llama")
    x = torch.randn(B, T, D)
    mask = padding_mask()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = block(x, mask)
    result = use_fused_attention(block, blocks=[""])
    with torch.autocast("cpu", dtype=torch.bfloat16), SDPABackendRecorder() as rec:
        out, weights = block(x, mask)
    assert result.fused_calls[""] == 1 and rec.calls == 1
    assert out.dtype == ref.dtype == torch.bfloat16 and weights.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
    # sample 0 fully masked (every key padded): the fp32 mask's lowest value must not become -inf (NaN) in bf16
    mask = torch.zeros(B, 1, 1, T).index_fill(0, torch.tensor([0]), torch.finfo(torch.float32).min)
    result.restore()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = block(x, mask)
    use_fused_attention(block, blocks=[""])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = block(x, mask)
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_rewrite_that_never_fires_warns_once_naming_the_op():
    class Einsum(nn.Module):
        def forward(self, q, k, v):
            scores = torch.einsum("bhid,bhjd->bhij", q, k) * 0.5
            return F.softmax(scores, dim=-1) @ v

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Einsum()

        def forward(self, q, k, v):
            return self.attn(q, k, v)

    model = Wrapper()
    q, k, v = qkv()
    ref = model(q, k, v)
    result = use_fused_attention(model, blocks=["attn"])
    with pytest.warns(
        UserWarning,
        match=r"rewrite of 'attn' \(Einsum\) did not fire in its forward: softmax ran on "
        r"a tensor that is not matmul\(q, k\^T\).*fix: call "
        r"F.scaled_dot_product_attention",
    ):
        out = model(q, k, v)
    assert torch.equal(out, ref) and result.fused_calls == {"attn": 0}
    assert "einsum" in result.not_fired["attn"]
    import warnings as _warnings

    with _warnings.catch_warnings():
        _warnings.simplefilter("error")  # once per block, not every forward
        model(q, k, v)


def test_outputs_keep_their_container_types():
    class Output(dict):
        pass

    class Returns(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = LibraryStyle("timm")

        def forward(self, x):
            out, weights = self.inner(x)
            return Output(out=out, weights=weights)

    torch.manual_seed(0)
    model = Returns()
    x = torch.randn(B, T, D)
    ref = model(x)
    result = use_fused_attention(model, blocks=[""])
    got = model(x)
    assert type(got) is Output and result.fused_calls[""] == 1
    torch.testing.assert_close(got["out"], ref["out"], rtol=1e-5, atol=1e-5)
    assert type(got["weights"]) is not torch.Tensor  # still a placeholder: nothing used it
    torch.testing.assert_close(got["weights"] * 1, ref["weights"], rtol=1e-5, atol=1e-6)
