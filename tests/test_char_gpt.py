"""The tiny char-level GPT: trains (loss falls below a stated threshold) and its first
steps equal PyTorch's from the same initial weights, batches and optimizer."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from dtm.models.char_gpt import CharTokenizer, TrainConfig, batches, model_config, train  # noqa: E402
from dtm.models.gpt2 import GPT2  # noqa: E402

# Uniform guessing over the ~60 characters costs ln(60) = 4.1 nats; the unigram
# distribution of the text about 3.1. Below 2.5 the model has learned which characters
# follow which (a measured run ends near 2.25).
THRESHOLD = 2.5


def test_char_gpt_learns():
    cfg = TrainConfig(steps=300)
    _, losses = train(cfg)
    assert losses[0] > 3.8
    assert np.mean(losses[-20:]) < THRESHOLD, losses[-20:]


def _torch_twin(model: GPT2) -> "transformers.GPT2LMHeadModel":
    c = model.config
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=c.layer_norm_epsilon))
    hf.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in model.hf_state_dict().items()})
    return hf.train()


def test_first_steps_match_torch():
    cfg = TrainConfig(steps=5, lr=3e-3)
    tok = CharTokenizer()
    from dtm.tensor import manual_seed

    manual_seed(cfg.seed)
    model = GPT2(model_config(cfg, tok))
    hf = _torch_twin(model)  # same initial weights, before dtm trains its copy
    _, losses = train(cfg, model=model)

    opt = torch.optim.AdamW(hf.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.steps, eta_min=cfg.lr / 10)
    want = []
    for _, (x, y) in zip(range(cfg.steps), batches(cfg, tok)):
        logits = hf(torch.from_numpy(x)).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, tok.vocab_size), torch.from_numpy(y).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        want.append(loss.item())
    np.testing.assert_allclose(losses, want, rtol=1e-4)
