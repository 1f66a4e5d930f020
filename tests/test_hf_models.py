"""Real model families from `transformers` under `torch.compile(backend="aotgrad")` (Inductor).

Each family is built small from its config (random init, no download, dropout off so eager and
compiled runs see the same numbers), then trained a few AdamW steps side by side with an eager copy,
comparing the loss, every grad (each parameter at its own scale: helpers.assert_grads_close) and
every buffer: two steps at batch size 2, a third at batch size 3
(Dynamo marks the batch dimension dynamic, so that step runs the symbolic-shape path), then one
`no_grad` evaluation; a few families also with `dynamic=True` from the first step. The families
differ in what their forward does: tensor constants (`torch.tensor(...)` inside forward), rotary
embeddings, grouped-query attention, sliding windows, relative position buckets, encoder-decoder
cross attention, convolutions and batch norm.

Slow (about half a minute per case on 2 cores, 5.5 minutes in all): `make test-long`.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_grads_close

import aotgrad  # noqa: F401  (registers the backend)

transformers = pytest.importorskip("transformers")

VOCAB = 128


def _families() -> dict:
    T = transformers
    text = dict(vocab_size=VOCAB)
    return {
        "bert": (T.BertConfig, T.BertForMaskedLM, "tokens", dict(
            text, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)),
        "gpt2": (T.GPT2Config, T.GPT2LMHeadModel, "tokens", dict(text, n_embd=64, n_layer=2, n_head=4)),
        "gpt_neo": (T.GPTNeoConfig, T.GPTNeoForCausalLM, "tokens", dict(
            text, hidden_size=64, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
            window_size=8)),
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, "tokens", dict(
            text, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128)),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, "tokens", dict(
            text, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, sliding_window=8)),
        "opt": (T.OPTConfig, T.OPTForCausalLM, "tokens", dict(
            text, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
            word_embed_proj_dim=64)),
        "t5": (T.T5Config, T.T5ForConditionalGeneration, "seq2seq", dict(
            text, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)),
        "bart": (T.BartConfig, T.BartForConditionalGeneration, "seq2seq", dict(
            text, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128)),
        "vit": (T.ViTConfig, T.ViTForImageClassification, "images", dict(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
            patch_size=8, num_labels=10)),
        "resnet": (T.ResNetConfig, T.ResNetForImageClassification, "images", dict(
            hidden_sizes=[16, 32], depths=[1, 1], embedding_size=16, num_labels=10)),
    }


def _build(config_cls, model_cls, options):
    config = config_cls(**options)
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    config.pad_token_id = 0
    if getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = 0
    torch.manual_seed(0)
    return model_cls(config)


def _batch(kind: str, batch_size: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    if kind == "images":
        return dict(pixel_values=torch.randn(batch_size, 3, 32, 32, generator=g),
                    labels=torch.randint(0, 10, (batch_size,), generator=g))
    tokens = torch.randint(0, VOCAB, (batch_size, 16), generator=g)
    labels = tokens if kind == "tokens" else torch.randint(0, VOCAB, (batch_size, 8), generator=g)
    return dict(input_ids=tokens, labels=labels)


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# Families whose graphs under `dynamic=True` hold what the symbolic path must carry: floats Dynamo
# passes as 0-d tensors (eps, pi, rotary scaling), views of intermediates with symbolic sizes
# (BERT's and GPT-2's logits), sizes returned across a graph break (Mistral).
DYNAMIC = ["bert", "gpt2", "llama", "mistral"]


@pytest.mark.long
@pytest.mark.parametrize(
    "family,dynamic", [(f, None) for f in _families()] + [(f, True) for f in DYNAMIC]
)
def test_family_trains_and_evaluates_like_eager(family, dynamic):
    config_cls, model_cls, kind, options = _families()[family]
    eager = _build(config_cls, model_cls, options).train()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="aotgrad", dynamic=dynamic)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step, batch_size in enumerate([2, 2, 3]):
        batch = _batch(kind, batch_size, seed=step)
        expected, got = eager(**batch).loss, compiled(**batch).loss
        expected.backward()
        got.backward()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        assert_grads_close(eager, model)  # each parameter at its own gradient's scale
        eager_opt.step()
        opt.step()
        eager_opt.zero_grad()
        opt.zero_grad()
        for (name, b), c in zip(eager.named_buffers(), model.buffers()):  # BatchNorm's running stats
            torch.testing.assert_close(c, b, rtol=1e-4, atol=1e-5, msg=name)
    eager.eval()
    model.eval()
    with torch.no_grad():
        batch = _batch(kind, 2, seed=7)
        torch.testing.assert_close(compiled(**batch).logits, eager(**batch).logits, rtol=1e-4, atol=1e-5)
