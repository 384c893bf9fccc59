"""use_fused_linear_cross_entropy on Hugging Face causal LMs built from configs (no download): the model's own loss
and gradients without its logits, checked on the first batch, refused where it would train another loss."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch

from lightning_accel.losses import linear_cross_entropy, use_fused_linear_cross_entropy

transformers = pytest.importorskip("transformers")
VOCAB = 300


def _llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():  # GPT-2 ties its head to the token embedding
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=1)
    return transformers.GPT2LMHeadModel(cfg)


def _pair(make):
    torch.manual_seed(0)
    own = make()
    torch.manual_seed(0)
    fused = make()
    return own, fused


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 12), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt not trained on
    mask = torch.ones_like(ids)
    mask[2, -3:] = 0
    return ids, labels, mask


@pytest.mark.parametrize("make", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_the_models_own_loss_and_gradients_without_its_logits(make):
    own, fused = _pair(make)
    handle = use_fused_linear_cross_entropy(fused, chunk_tokens=5)
    ids, labels, mask = _batch()
    for _ in range(2):  # the first call is also checked against the model's own loss; the second is not
        torch.manual_seed(3)  # dropout draws the same in both models
        a = own(input_ids=ids, attention_mask=mask, labels=labels)
        torch.manual_seed(3)
        b = fused(input_ids=ids, attention_mask=mask, labels=labels)
        torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
        assert b.logits is None and a.logits.shape == (3, 12, VOCAB)
        own.zero_grad()
        fused.zero_grad()
        a.loss.backward()
        b.loss.backward()
        for (name, p), q in zip(own.named_parameters(), fused.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert handle.checked and handle.fused_calls == 2
    # without labels (generation, evaluation by logits) the logits are built as before
    fused.eval()
    torch.testing.assert_close(fused(input_ids=ids).logits, own.eval()(input_ids=ids).logits)
    assert list(fused.state_dict()) == list(own.state_dict())  # nothing renamed: checkpoints load either way
    handle.remove()
    fused.train()
    assert fused(input_ids=ids, labels=labels).logits is not None


def test_num_items_in_batch_sums_over_the_given_count_like_the_model():
    own, fused = _pair(_llama)
    use_fused_linear_cross_entropy(fused)
    ids, labels, _ = _batch()
    own.eval(), fused.eval()
    count = torch.tensor(40)
    a = own(input_ids=ids, labels=labels, num_items_in_batch=count).loss
    b = fused(input_ids=ids, labels=labels, num_items_in_batch=count).loss
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_a_model_that_changes_its_logits_before_the_loss_is_refused_on_the_first_batch_and_put_back():
    model = _llama()
    own_loss = model.loss_function

    def scaled(logits, labels, vocab_size, **kwargs):  # a logit scale between the head and the loss
        return own_loss(logits * 2.0, labels, vocab_size, **kwargs)

    model.loss_function = scaled
    use_fused_linear_cross_entropy(model)
    ids, labels, _ = _batch()
    with pytest.raises(ValueError, match="own loss on the first sample is .* the fused one"):
        model(input_ids=ids, labels=labels)
    assert model.loss_function is scaled and "forward" not in vars(model.lm_head)
    assert model(input_ids=ids, labels=labels).logits.shape == (3, 12, VOCAB)  # trains as it did


def test_what_it_does_not_recognise_is_refused_with_the_function_to_use():
    with pytest.raises(TypeError, match="not a Sequential: .*linear_cross_entropy"):
        use_fused_linear_cross_entropy(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    cfg = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, final_logit_softcapping=30.0,
    )  # fmt: skip
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0"):
        use_fused_linear_cross_entropy(transformers.Gemma2ForCausalLM(cfg))
    model = _llama()
    use_fused_linear_cross_entropy(model)
    with pytest.raises(ValueError, match="already called"):
        use_fused_linear_cross_entropy(model)


def test_a_training_call_without_labels_warns_once_that_the_logits_were_built():
    model = _llama()
    use_fused_linear_cross_entropy(model)
    ids, _, _ = _batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(input_ids=ids)
        model(input_ids=ids)
    assert [str(w.message) for w in caught if "without labels=" in str(w.message)] == [
        "use_fused_linear_cross_entropy: LlamaForCausalLM was called without labels=, so it built its logits as "
        "before; pass labels= to the model (its output's loss is then computed without the logits), or call "
        "linear_cross_entropy(hidden_states, lm_head.weight, targets)"
    ]


class CausalLM(pl.LightningModule):
    def __init__(self, fused: bool):
        super().__init__()
        torch.manual_seed(0)
        self.model = _llama()
        if fused:
            use_fused_linear_cross_entropy(self.model)
        self.losses: list[float] = []

    def training_step(self, batch, i):
        ids, labels = batch
        loss = self.model(input_ids=ids, labels=labels).loss
        self.losses.append(loss.item())
        return loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(2)
        ids = torch.randint(0, VOCAB, (16, 12), generator=g)
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, ids), batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_lightning_fit_trains_as_with_the_models_own_loss():
    runs = {}
    for fused in (False, True):
        module = CausalLM(fused)
        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(
            accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )  # fmt: skip
        trainer.fit(module)
        runs[fused] = module.losses
    assert len(runs[True]) == 4
    torch.testing.assert_close(torch.tensor(runs[True]), torch.tensor(runs[False]), rtol=1e-4, atol=1e-5)


def test_the_function_on_a_hand_written_head_equals_the_models_loss():
    model = _gpt2().eval()
    ids, labels, _ = _batch()
    out = model(input_ids=ids, labels=labels, output_hidden_states=True)
    hidden = out.hidden_states[-1][:, :-1]  # each token predicts the next one
    ours = linear_cross_entropy(hidden, model.lm_head.weight, labels[:, 1:])
    torch.testing.assert_close(ours, out.loss, rtol=1e-5, atol=1e-6)
