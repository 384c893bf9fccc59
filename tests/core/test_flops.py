import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_accel.core.flops import FlopCounter, count_flops, transformer_flops_per_token
from lightning_accel.demo.model import GPT, GPTConfig


def test_linear_forward_and_backward_hand_count():
    b, i, o = 8, 16, 32
    layer = nn.Linear(i, o)
    x = torch.randn(b, i)
    assert count_flops(layer, x, backward=False) == 2 * b * i * o
    # backward: weight grad only (the input does not require grad): another 2·b·i·o
    assert count_flops(layer, x) == 4 * b * i * o
    # with an input that requires grad, autograd also computes the input grad: 6·b·i·o
    assert count_flops(layer, x.clone().requires_grad_()) == 6 * b * i * o


def test_mlp_hand_count():
    b, d, h = 4, 10, 20
    mlp = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, 3))
    fwd = 2 * b * d * h + 2 * b * h * 3
    # second layer: weight grad + input grad; first layer: weight grad only
    bwd = 2 * b * h * 3 * 2 + 2 * b * d * h
    assert count_flops(mlp, torch.randn(b, d)) == fwd + bwd


def test_attention_hand_count():
    b, heads, t, dh = 2, 4, 16, 8
    q, k, v = (torch.randn(b, heads, t, dh, requires_grad=True) for _ in range(3))

    class Attn(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v)

    fwd = 2 * (2 * b * heads * t * t * dh)  # q·kᵀ and p·v
    assert count_flops(Attn(), (q, k, v), backward=False) == fwd
    # backward: grads of v, the probabilities, q and k (4 products against the forward's 2); the flash
    # kernel's recomputation of the scores is not a model FLOP
    assert count_flops(Attn(), (q, k, v)) == fwd + 2 * fwd


def test_count_flops_leaves_training_state_untouched():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    model.train()
    x = torch.randn(16, 8)
    model(x).sum().backward()  # grads exist from a "previous micro-batch"
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    rng = torch.get_rng_state()

    flops = count_flops(model, x)

    assert flops > 0
    assert torch.equal(torch.get_rng_state(), rng)
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
        assert torch.equal(p.grad, grads[n]), n
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    assert model.training


def test_count_flops_mapping_batch_and_custom_loss():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, scale):
            return {"loss": (self.lin(x) * scale).mean(), "other": 1}

    assert count_flops(Model(), {"x": torch.randn(2, 4), "scale": 2.0}) == 4 * 2 * 4 * 4
    out = count_flops(Model(), {"x": torch.randn(2, 4), "scale": 2.0}, loss_fn=lambda o: o["loss"] * 2)
    assert out == 4 * 2 * 4 * 4


def test_count_flops_rejects_output_without_tensor():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            self.lin(x)
            return "done"

    with pytest.raises(TypeError, match="loss_fn"):
        count_flops(Model(), torch.randn(1, 2))
    with pytest.raises(TypeError, match="nn.Module"):
        count_flops(lambda x: x, torch.randn(1))


def test_flop_counter_start_stop():
    counter = FlopCounter()
    counter.start()
    assert counter.running
    torch.mm(torch.randn(3, 4), torch.randn(4, 5))
    assert counter.stop() == 2 * 3 * 4 * 5
    assert not counter.running
    with pytest.raises(RuntimeError):
        counter.stop()


def test_transformer_formula_values_and_validation():
    assert transformer_flops_per_token(100, 2, 8, 16) == 6 * 100 + 12 * 2 * 8 * 16
    for bad in (0, -1, "3", None, True):
        with pytest.raises(ValueError, match="positive"):
            transformer_flops_per_token(bad, 2, 8, 16)


@pytest.mark.parametrize("cfg", [GPTConfig(), GPTConfig(n_layer=2, d_model=64, n_head=2, seq_len=128)])
def test_gpt_count_matches_palm_formula_within_5_percent(cfg):
    model = GPT(cfg)
    batch = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    counted = count_flops(model, batch, loss_fn=lambda logits: logits.float().logsumexp(-1).mean())
    formula = transformer_flops_per_token(model.num_params(), cfg.n_layer, cfg.d_model, cfg.seq_len) * batch.numel()
    assert abs(counted / formula - 1) < 0.05, (counted, formula)
