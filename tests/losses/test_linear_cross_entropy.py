"""linear_cross_entropy: the loss and the gradients of F.cross_entropy(hidden @ W.T + b, y), without the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_accel.losses import LinearCrossEntropy, default_chunk_tokens, linear_cross_entropy
from lightning_accel.losses.linear_cross_entropy import MIN_CHUNK_LOGITS

VOCAB, HIDDEN = 50, 16


def _inputs(dtype=torch.float64, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(3, 7, HIDDEN, dtype=dtype, generator=g).requires_grad_()
    w = torch.randn(VOCAB, HIDDEN, dtype=dtype, generator=g).requires_grad_()
    b = torch.randn(VOCAB, dtype=dtype, generator=g).requires_grad_() if bias else None
    y = torch.randint(0, VOCAB, (3, 7), generator=g)
    y[0, :3] = -100  # ignored tokens
    y[2, 5] = -100
    return h, w, b, y


def _plain(h, w, b, y, **kwargs):
    out = F.cross_entropy(F.linear(h, w, b).reshape(-1, VOCAB), y.reshape(-1), **kwargs)
    return out.reshape(y.shape) if kwargs.get("reduction") == "none" else out


def _grads(out, tensors, reduction):
    upstream = torch.linspace(-1.0, 2.0, out.numel(), dtype=out.dtype).reshape(out.shape)
    return torch.autograd.grad(out, tensors, upstream if reduction == "none" else torch.tensor(1.7, dtype=out.dtype))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [None, 1, 4, 64])
def test_loss_and_gradients_equal_the_plain_head_to_round_off(reduction, smoothing, bias, chunk):
    h, w, b, y = _inputs(bias=bias)
    tensors = [h, w] + ([b] if bias else [])
    ours = linear_cross_entropy(h, w, y, b, label_smoothing=smoothing, reduction=reduction, chunk_tokens=chunk)
    theirs = _plain(h, w, b, y, label_smoothing=smoothing, reduction=reduction)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    for a, c in zip(_grads(ours, tensors, reduction), _grads(theirs, tensors, reduction)):
        torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


def test_float32_and_a_tied_head_and_the_module_form():
    h, w, _, y = _inputs(dtype=torch.float32, bias=False)
    emb = torch.nn.Embedding(VOCAB, HIDDEN)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    head.weight = emb.weight  # tied, as GPT-2 and nanoGPT do
    ids = torch.randint(0, VOCAB, (3, 7))
    loss = LinearCrossEntropy(head, chunk_tokens=5)(emb(ids) + h, y)
    (g_ours,) = torch.autograd.grad(loss, [emb.weight])  # through the embedding and through the head
    (g_plain,) = torch.autograd.grad(_plain(emb(ids) + h, head.weight, None, y), [emb.weight])
    torch.testing.assert_close(g_ours, g_plain, rtol=1e-5, atol=1e-6)


def test_under_bf16_autocast_it_matches_the_plain_head_in_the_same_dtypes():
    h, w, b, y = _inputs(dtype=torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(h, w, y, b, chunk_tokens=4)
        theirs = _plain(h, w, b, y)
    assert ours.dtype == theirs.dtype == torch.float32
    torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=2e-3)
    for a, c in zip(torch.autograd.grad(ours, [h, w, b]), torch.autograd.grad(theirs, [h, w, b])):
        assert a.dtype == c.dtype
        torch.testing.assert_close(a, c, rtol=3e-2, atol=3e-3)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_the_full_logits_are_never_built(reduction):
    tokens, vocab, hidden = 512, 4096, 32
    h = torch.randn(tokens, hidden, requires_grad=True)
    w = torch.randn(vocab, hidden, requires_grad=True)
    y = torch.randint(0, vocab, (tokens,))
    with _LargestTensor() as seen:  # chunks of 4 tokens: 4 x 4096 logits, as many elements as the hidden states
        loss = linear_cross_entropy(h, w, y, reduction=reduction, chunk_tokens=4)
        loss.sum().backward()
    assert seen.largest == vocab * hidden  # the head and its gradient: nothing of tokens x vocab
    with _LargestTensor() as plain:
        _plain_big = F.cross_entropy(h @ w.T, y, reduction=reduction)
        _plain_big.sum().backward()
    assert plain.largest == tokens * vocab


@pytest.mark.parametrize(
    ("tokens", "hidden", "vocab", "chunk"),
    [
        (2048, 256, 32768, 512),  # Liger's rule gives 16 tokens; the floor of 2**24 logits gives 512
        (2048, 256, 131072, 128),  # the floor again: 128 x 131072 = 2**24
        (65536, 4096, 131072, 2048),  # a real LLM batch: Liger's rule (2048 x 131072 = 65536 x 4096) is above the floor
        (100, 32, 4096, 100),  # fewer tokens than a chunk: one chunk
        (1, 1, 1, 1),
    ],
)
def test_the_default_chunk_holds_the_hidden_states_worth_of_logits_and_no_fewer_than_the_floor(
    tokens, hidden, vocab, chunk
):
    assert default_chunk_tokens(tokens, hidden, vocab) == chunk
    assert chunk == tokens or chunk * vocab >= MIN_CHUNK_LOGITS


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(reduction="avg"), "reduction='avg'"),
        (dict(backend="triton"), "backend='triton'"),
        (dict(label_smoothing=1.5), "label_smoothing=1.5"),
        (dict(chunk_tokens=0), "chunk_tokens=0"),
    ],
)
def test_bad_options_are_named(kwargs, match):
    h, w, b, y = _inputs()
    with pytest.raises(ValueError, match=match):
        linear_cross_entropy(h, w, y, b, **kwargs)


def test_bad_shapes_are_named():
    h, w, b, y = _inputs()
    with pytest.raises(ValueError, match=r"weight \(16, 50\)"):
        linear_cross_entropy(h, w.T, y)
    with pytest.raises(ValueError, match=r"target \(3, 6\)"):
        linear_cross_entropy(h, w, y[:, :6])
    with pytest.raises(ValueError, match="class indices"):
        linear_cross_entropy(h, w, y.double())
    with pytest.raises(TypeError, match="takes the output nn.Linear"):
        LinearCrossEntropy(torch.nn.Embedding(3, 4))  # type: ignore[arg-type]


def test_a_mean_over_no_target_is_nan_like_torch():
    h, w, b, y = _inputs()
    y[:] = -100
    assert torch.isnan(linear_cross_entropy(h, w, y, b)) and torch.isnan(_plain(h, w, b, y))
