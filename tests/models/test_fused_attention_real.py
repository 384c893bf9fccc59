"""``use_fused_attention`` on real code: Hugging Face eager attention (Llama, GPT-2, BERT, ViT) rewritten and
counted, the library's own switch preferred, a model that cannot switch says why; nanoGPT's manual path."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import default_collate

from lightning_accel import SDPABackendRecorder, use_fused_attention
from lightning_accel._compat import hf_attn_implementation
from tests.models.zoo import FAMILIES, HAVE_TRANSFORMERS, LAYERS, NO_TRANSFORMERS, NanoGPT, bert, gpt2, llama, vit

needs_hf = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason=NO_TRANSFORMERS)
HF = {"llama": llama, "gpt2": gpt2, "bert": bert, "vit": vit}


def batch(name: str, n: int = 3) -> dict:
    g = torch.Generator().manual_seed(0)
    return default_collate([FAMILIES[name].sample(g) for _ in range(n)])


def attention_modules(model) -> list[str]:
    """The library's attention modules, outermost (GPT2Attention, LlamaAttention, BertAttention, ViTAttention)."""
    names: list[str] = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Attention") and not any(name.startswith(n + ".") for n in names):
            names.append(name)
    return names


def step(model, inputs):
    model.zero_grad()
    out = model(**inputs)
    loss = out.loss if out.loss is not None else out.logits.square().mean()
    loss.backward()
    return out.logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def inputs_of(name: str) -> dict:
    b = batch(name)
    return {**b, "labels": b["input_ids"]} if "pixel_values" not in b and "attention_mask" not in b else b


@needs_hf
@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", list(HF))
def test_eager_attention_rewritten_on_every_layer_same_results(name, mode):
    torch.manual_seed(0)
    model = HF[name]("eager").train(mode == "train")
    inputs = inputs_of(name)
    ref_logits, ref_grads = step(model, inputs)
    blocks = attention_modules(model)
    assert len(blocks) == LAYERS
    result = use_fused_attention(model, blocks=blocks, library_switch=False)  # rewrite, not the library's switch
    with SDPABackendRecorder() as rec:
        logits, grads = step(model, inputs)
    assert result.fused_calls == {b: 1 for b in blocks} and result.not_fired == {}
    assert rec.calls == LAYERS and hf_attn_implementation(model) == "eager"
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
    result.restore()
    with SDPABackendRecorder() as rec:
        model(**inputs)
    assert rec.calls == 0  # eager again


@needs_hf
@pytest.mark.parametrize("name", ["llama", "bert"])
def test_hugging_face_models_switched_with_the_librarys_own_setting(name):
    torch.manual_seed(0)
    model = HF[name]("eager").eval()
    inputs = inputs_of(name)
    with torch.no_grad():
        ref = model(**inputs).logits
    result = use_fused_attention(model)  # no blocks named: the HF model inside is found and switched
    assert result.library == {"": "eager"} and hf_attn_implementation(model) == "sdpa" and result.blocks == []
    with torch.no_grad(), SDPABackendRecorder() as rec:
        out = model(**inputs).logits
    assert rec.calls == LAYERS
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    result.restore()
    assert hf_attn_implementation(model) == "eager"


@needs_hf
def test_model_that_cannot_switch_says_why_and_is_rewritten_instead():
    from transformers import GPT2LMHeadModel

    class NoSdpaGPT2(GPT2LMHeadModel):  # a model class without SDPA support (custom / remote code)
        _supports_sdpa = False

    torch.manual_seed(0)
    model = NoSdpaGPT2(gpt2("eager").config).eval()
    inputs = inputs_of("gpt2")
    with torch.no_grad():
        ref = model(**inputs).logits
    with pytest.warns(
        UserWarning,
        match=r"NoSdpaGPT2: set_attn_implementation\('sdpa'\) refused: .*Rewriting its "
        r"hand-written attention instead \(2 modules\)",
    ):
        result = use_fused_attention(model)
    assert list(result.unswitchable) == [""] and result.library == {}
    assert result.blocks == attention_modules(model)
    with torch.no_grad():
        out = model(**inputs).logits
    assert sum(result.fused_calls.values()) == LAYERS
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_nanogpt_manual_path_fused_in_every_block():
    torch.manual_seed(0)
    model = NanoGPT(flash=False)
    idx = batch("nanogpt")["input_ids"]
    ref = model(idx)
    result = use_fused_attention(model, blocks=[f"h.{i}.attn" for i in range(LAYERS)])
    with SDPABackendRecorder() as rec:
        out = model(idx)
    assert rec.calls == LAYERS and all(n == 1 for n in result.fused_calls.values())
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["nanogpt", "demo", *(["gpt2_eager", "gpt2_sdpa", "llama_sdpa"] * HAVE_TRANSFORMERS)])
def test_the_autopilot_does_not_offer_fused_attention_to_blocks_that_call_sdpa_already(name):
    from types import SimpleNamespace

    from lightning_accel.callbacks.autopilot.fixes.attention import FusedAttention
    from lightning_accel.demo.model import GPT, GPTConfig

    models = {
        "nanogpt": lambda: NanoGPT(flash=True),  # its forward has both paths: the manual one may run
        "demo": lambda: GPT(GPTConfig(seq_len=16, n_layer=1, d_model=32)),
        "gpt2_eager": lambda: gpt2("eager"),
        "gpt2_sdpa": lambda: gpt2("sdpa"),
        "llama_sdpa": lambda: llama("sdpa"),
    }
    why = FusedAttention().unavailable(SimpleNamespace(module=models[name]()))
    if name in ("demo", "gpt2_sdpa", "llama_sdpa"):
        assert why == "the attention already runs fused (its blocks call F.scaled_dot_product_attention)"
    else:
        assert why is None
