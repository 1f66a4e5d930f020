"""The models of the GPU training suite (gpu_suite.py): each a module whose forward returns the loss.

transformers models are built from configs made here (random weights, no download): GPT-2, BERT
(`BertForMaskedLM`), Llama, T5. Vision models come from timm when it imports (ResNet-50, ViT-B/16);
otherwise plain-torch stand-ins of the same architecture are used (timm imports torchvision, which
does not load beside the CPU torch on the development machines). Dropout is off everywhere, so every
variant computes the same function and the losses can be compared with eager's.

`size` is "full" (the GPU rows), "mid" (CPU-sized layers, but the real vocabularies and class
counts, whose logits are where the memory of a training step peaks: what a CPU run can compare
aotgrad's activation peak with Inductor's on), or "tiny" (a CPU dry run in seconds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class SuiteModel:
    name: str  # the row's name
    source: str  # "transformers", "timm" or "stand-in"
    module: nn.Module  # forward(*batch) -> scalar loss
    batches: list[tuple]  # one per step, on the device; the same for every variant
    shape: str  # what a batch is, for the table
    mode: str | None = None  # torch.compile(mode=...)


class HFLoss(nn.Module):
    """A transformers model called with keyword arguments; its `.loss` is the output."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.keys = keys

    def forward(self, *args):
        return self.model(**dict(zip(self.keys, args))).loss


class ClassifierLoss(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return F.cross_entropy(self.model(x), y)


# ----------------------------------------------------------------------------------------------
# Plain-torch stand-ins for timm's ResNet-50 and ViT-B/16


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet with bottleneck blocks: layers=(3, 4, 6, 3), width=64 is ResNet-50."""

    def __init__(self, layers=(3, 4, 6, 3), width: int = 64, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, cin = [], width
        for i, n in enumerate(layers):
            w = width * 2**i
            for j in range(n):
                blocks.append(Bottleneck(cin, w, 2 if (j == 0 and i > 0) else 1))
                cin = w * Bottleneck.expansion
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class ViTBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, c))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViT(nn.Module):
    """timm's vit_base_patch16_224 layout: dim=768, depth=12, heads=12, patch 16 on 224²."""

    def __init__(self, image: int = 224, patch: int = 16, dim: int = 768, depth: int = 12, heads: int = 12,
                 num_classes: int = 1000):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[ViTBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def _timm():
    try:
        import timm
    except Exception:  # not installed, or torchvision does not load beside this torch
        return None
    return timm


# ----------------------------------------------------------------------------------------------
# The rows


def _tokens(vocab: int, batch: int, seq: int, steps: int, device, gen: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(0, vocab, (batch, seq), generator=gen).to(device) for _ in range(steps)]


def gpt2(size: str, device, steps: int, gen, layers: int = 12, dim: int = 768, batch: int = 8, seq: int = 512,
         name: str = "gpt2", mode: str | None = None) -> SuiteModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    if size == "tiny":
        layers, dim, batch, seq, vocab, heads = 2, 64, 2, 32, 128, 2
    elif size == "mid":
        layers, dim, batch, seq, vocab, heads = 2, 256, 2, 256, 50257, 4
    else:
        vocab, heads = 50257, max(dim // 64, 1)
    cfg = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=max(seq, 64),
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    mod = HFLoss(GPT2LMHeadModel(cfg), ("input_ids", "labels"))
    batches = [(t, t) for t in _tokens(vocab, batch, seq, steps, device, gen)]
    return SuiteModel(name, "transformers", mod, batches, f"{layers}L {dim}, {batch}×{seq}", mode)


def bert(size: str, device, steps: int, gen) -> SuiteModel:
    from transformers import BertConfig, BertForMaskedLM

    if size == "tiny":
        cfg = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        batch, seq = 2, 32
    elif size == "mid":
        cfg = BertConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        batch, seq = 4, 128
    else:
        cfg = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # BERT-base
        batch, seq = 16, 256
    mod = HFLoss(BertForMaskedLM(cfg), ("input_ids", "labels"))
    toks = _tokens(cfg.vocab_size, batch, seq, steps, device, gen)
    batches = []
    for t in toks:  # 15% of the positions are predicted, the rest ignored (-100)
        keep = torch.rand(t.shape, generator=gen).to(device) < 0.15
        batches.append((t, torch.where(keep, t, torch.full_like(t, -100))))
    return SuiteModel("bert", "transformers", mod, batches,
                      f"{cfg.num_hidden_layers}L {cfg.hidden_size}, {batch}×{seq}")


def llama(size: str, device, steps: int, gen) -> SuiteModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    if size == "tiny":
        cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        batch, seq = 2, 32
    elif size == "mid":
        cfg = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                          num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512)
        batch, seq = 2, 256
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                          num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048)
        batch, seq = 4, 1024
    mod = HFLoss(LlamaForCausalLM(cfg), ("input_ids", "labels"))
    batches = [(t, t) for t in _tokens(cfg.vocab_size, batch, seq, steps, device, gen)]
    return SuiteModel("llama", "transformers", mod, batches,
                      f"{cfg.num_hidden_layers}L {cfg.hidden_size}, {batch}×{seq}")


def t5(size: str, device, steps: int, gen) -> SuiteModel:
    from transformers import T5Config, T5ForConditionalGeneration

    if size == "tiny":
        cfg = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                       dropout_rate=0.0, decoder_start_token_id=0)
        batch, seq, tgt = 2, 32, 16
    elif size == "mid":
        cfg = T5Config(vocab_size=32128, d_model=256, d_kv=32, d_ff=1024, num_layers=2, num_heads=8,
                       dropout_rate=0.0, decoder_start_token_id=0)
        batch, seq, tgt = 4, 128, 32
    else:  # t5-small
        cfg = T5Config(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8,
                       dropout_rate=0.0, decoder_start_token_id=0)
        batch, seq, tgt = 16, 256, 64
    mod = HFLoss(T5ForConditionalGeneration(cfg), ("input_ids", "labels"))
    src = _tokens(cfg.vocab_size, batch, seq, steps, device, gen)
    labels = _tokens(cfg.vocab_size, batch, tgt, steps, device, gen)
    return SuiteModel("t5", "transformers", mod, list(zip(src, labels)),
                      f"{cfg.num_layers}L {cfg.d_model}, {batch}×{seq}→{tgt}")


def _images(batch: int, image: int, classes: int, steps: int, device, gen) -> list[tuple]:
    return [(torch.randn(batch, 3, image, image, generator=gen).to(device),
             torch.randint(0, classes, (batch,), generator=gen).to(device)) for _ in range(steps)]


def resnet50(size: str, device, steps: int, gen) -> SuiteModel:
    timm = None if size != "full" else _timm()
    if size == "tiny":
        net, source, batch, image, classes = ResNet((1, 1, 1, 1), 8, 10), "stand-in", 4, 32, 10
    elif size == "mid":
        net, source, batch, image, classes = ResNet((1, 1, 1, 1), 16, 1000), "stand-in", 8, 64, 1000
    elif timm is not None:
        net, source, batch, image, classes = timm.create_model("resnet50", num_classes=1000), "timm", 64, 224, 1000
    else:
        net, source, batch, image, classes = ResNet(), "stand-in", 64, 224, 1000
    return SuiteModel("resnet50", source, ClassifierLoss(net), _images(batch, image, classes, steps, device, gen),
                      f"{batch}×3×{image}²")


def vit(size: str, device, steps: int, gen) -> SuiteModel:
    timm = None if size != "full" else _timm()
    if size == "tiny":
        net, source, batch, image, classes = ViT(32, 8, 32, 2, 2, 10), "stand-in", 4, 32, 10
    elif size == "mid":
        net, source, batch, image, classes = ViT(64, 8, 128, 2, 4, 1000), "stand-in", 8, 64, 1000
    elif timm is not None:
        net = timm.create_model("vit_base_patch16_224", num_classes=1000, drop_rate=0.0)
        source, batch, image, classes = "timm", 64, 224, 1000
    else:
        net, source, batch, image, classes = ViT(), "stand-in", 64, 224, 1000
    return SuiteModel("vit", source, ClassifierLoss(net), _images(batch, image, classes, steps, device, gen),
                      f"{batch}×3×{image}²")


MODELS: dict[str, Callable[..., SuiteModel]] = {
    "gpt2": gpt2,
    "gpt2_6l": lambda size, device, steps, gen: gpt2(size, device, steps, gen, layers=6, name="gpt2_6l"),
    "bert": bert,
    "llama": llama,
    "t5": t5,
    "resnet50": resnet50,
    "vit": vit,
    "gpt2_small_ro": lambda size, device, steps, gen: gpt2(size, device, steps, gen, layers=2, dim=256, batch=4,
                                                           seq=128, name="gpt2_small_ro", mode="reduce-overhead"),
}
