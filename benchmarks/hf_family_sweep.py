"""A sweep of ~100 transformers families (tiny configs, CPU): does each train like eager under
`torch.compile(backend=BACKEND)`, and where it does not, does the reference backend fail the same way?

Per family: a tiny config of the family's causal-LM, masked-LM, seq2seq or image-classification
model (dropout, drop-path, layer drop and router jitter zeroed), three AdamW steps (batches of 2, 2
and 3: the third recompiles; each step starts both from eager's weights) and an eval forward, every
loss, gradient and float buffer against eager's. A family that fails under BACKEND is re-run under REFERENCE; its row then says whether the
failure is shared, with the first step's loss and worst gradient error under each, so "misses
eager by the same amount" reads off the row. Exits 1 if a family fails under BACKEND alone.

    make sweep-hf                                              # aotgrad vs inductor, every family
    python benchmarks/hf_family_sweep.py --backend aotgrad_eager --reference aot_eager --kinds img
    python benchmarks/hf_family_sweep.py --autocast --families gpt_neox,bert   # bf16 autocast, looser

Families the installed transformers cannot build, or train eagerly, from the tiny config are listed
as skipped.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from dataclasses import dataclass

import torch

V = 128  # vocabulary
_TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=V,
             num_key_value_heads=2, head_dim=16, d_model=64, encoder_layers=1, decoder_layers=1,
             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
             d_kv=16, d_ff=128, num_layers=2, num_heads=4, n_embd=64, n_layer=2, n_head=4, n_inner=128,
             max_position_embeddings=64, num_labels=10, image_size=32, pad_token_id=0, decoder_start_token_id=0,
             num_local_experts=4, num_experts=4, num_experts_per_tok=2, sliding_window=8, embedding_size=64,
             rotary_dim=8, partial_rotary_factor=0.5, n_positions=64)
FAMILIES = {
    "causal": ["gpt2", "llama", "qwen2", "qwen3", "gemma", "gemma2", "phi", "phi3", "falcon", "bloom", "gptj",
               "gpt_bigcode", "stablelm", "olmo", "cohere", "granite", "starcoder2", "mixtral", "qwen2_moe",
               "gpt_neox", "codegen", "persimmon", "mpt", "xglm", "biogpt", "ctrl", "rwkv", "mamba",
               "recurrent_gemma", "jamba", "dbrx", "olmoe", "glm", "nemotron", "helium", "phimoe",
               "gemma3_text", "llama4_text", "deepseek_v3", "smollm3", "exaone4", "ernie4_5", "seed_oss",
               "hunyuan_v1_dense"],
    "mlm": ["bert", "distilbert", "roberta", "albert", "electra", "deberta", "deberta-v2", "mobilebert",
            "xlm-roberta", "mpnet", "convbert", "funnel", "camembert", "ernie", "megatron-bert", "roformer",
            "squeezebert", "nystromformer", "yoso", "modernbert", "rembert", "data2vec-text", "xmod", "big_bird",
            "longformer", "canine"],
    "s2s": ["t5", "bart", "mt5", "marian", "pegasus", "mbart", "blenderbot", "prophetnet", "led", "m2m_100",
            "plbart", "umt5", "longt5", "switch_transformers"],
    "img": ["vit", "deit", "beit", "swin", "convnext", "convnextv2", "regnet", "mobilevit", "mobilenet_v2",
            "efficientnet", "levit", "poolformer", "dinov2", "data2vec-vision", "swinv2", "cvt", "pvt",
            "focalnet", "bit", "dinat", "vit_msn", "mobilenet_v1", "van", "resnet", "hiera", "textnet"],
}
KIND = {fam: kind for kind, fams in FAMILIES.items() for fam in fams}
# Families whose config reads the shared keys differently: keys dropped, then keys set.
_DROP = {**{t5: ("encoder_layers", "decoder_layers") for t5 in ("t5", "mt5", "umt5", "longt5", "switch_transformers")},
         "falcon": ("head_dim",),  # a property there
         "funnel": ("num_hidden_layers",),  # block_sizes instead
         "deepseek_v3": ("head_dim", "partial_rotary_factor", "rotary_dim")}  # its own q/k/v head sizes
_SET = {"funnel": dict(block_sizes=[1, 1], d_head=16, n_head=4, d_inner=128),
        "dbrx": dict(n_heads=4, n_layers=2, max_seq_len=64,
                     attn_config=dict(rope_theta=10000.0, kv_n_heads=2, clip_qkv=8.0),
                     ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
        "deepseek_v3": dict(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=32,
                            n_routed_experts=4, moe_intermediate_size=64, first_k_dense_replace=1, n_group=1,
                            topk_group=1)}
_RANDOM = ("dropout", "pdrop", "drop_path", "layerdrop", "jitter")  # config floats zeroed: eager must be repeatable


@dataclass
class Row:
    family: str
    status: str  # "ok", "shared" (fails under the reference too), "own", "skipped" (eager fails)
    seconds: float = 0.0
    message: str = ""
    first_step: str = ""  # for failures: first-step loss / gradient error under each backend


def build(family: str) -> tuple[torch.nn.Module, str]:
    """The family's tiny model (seeded: every call gives the same weights) and its kind."""
    import transformers

    kind = KIND[family]
    kw = dict(num_labels=10, image_size=32) if kind == "img" else dict(_TEXT)
    for key in _DROP.get(family, ()):
        kw.pop(key)
    kw.update(_SET.get(family, {}))
    cfg = transformers.AutoConfig.for_model(family, **kw)
    for k, v in list(vars(cfg).items()):
        if isinstance(v, float) and any(word in k for word in _RANDOM):
            setattr(cfg, k, 0.0)
    cfg.use_cache = False
    auto = dict(causal=transformers.AutoModelForCausalLM, mlm=transformers.AutoModelForMaskedLM,
                s2s=transformers.AutoModelForSeq2SeqLM, img=transformers.AutoModelForImageClassification)[kind]
    cls = auto._model_mapping[type(cfg)]
    if isinstance(cls, (tuple, list)):
        cls = cls[0]
    torch.manual_seed(0)
    model = cls(cfg)
    if hasattr(model, "set_default_language"):  # X-MOD's adapters are per language
        model.set_default_language(cfg.languages[0])
    return model, kind


def batch(kind: str, size: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if kind == "img":
        return dict(pixel_values=torch.randn(size, 3, 32, 32, generator=g),
                    labels=torch.randint(0, 10, (size,), generator=g))
    tokens = torch.randint(1, V, (size, 16), generator=g)
    labels = torch.randint(1, V, (size, 8), generator=g) if kind == "s2s" else tokens
    return dict(input_ids=tokens, labels=labels)


def _grads_close(eager: torch.nn.Module, model: torch.nn.Module, rtol: float = 1e-3, rel_atol: float = 1e-4) -> None:
    """Each parameter's gradient at its own scale (tests/helpers.assert_grads_close's rule)."""
    named = list(eager.named_parameters())
    largest = lambda g: g.abs().max().item() if g.numel() else 0.0  # noqa: E731 -- MobileBERT has empty parameters
    scale = max((largest(p.grad) for _, p in named if p.grad is not None), default=0.0)
    for (name, p), q in zip(named, model.parameters()):
        if (p.grad is None) != (q.grad is None):
            raise AssertionError(f"{name}: eager's gradient is {p.grad is None and 'None' or 'a tensor'}")
        if p.grad is not None:
            atol = max(rel_atol * largest(p.grad), 1e-6 * scale, 1e-12)
            torch.testing.assert_close(q.grad, p.grad, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def _start_from(eager: torch.nn.Module, model: torch.nn.Module) -> None:
    """Writes eager's weights and buffers into the compiled model's own tensors, in place."""
    with torch.no_grad():
        for theirs, ours in zip([*eager.parameters(), *eager.buffers()], [*model.parameters(), *model.buffers()]):
            ours.copy_(theirs)


def train_like_eager(family: str, backend, autocast: bool = False) -> None:
    """Three AdamW steps and an eval forward, compiled and eager; raises at the first difference.

    Each step starts both models from eager's weights and buffers: AdamW turns a rounding-sized
    difference in a near-zero gradient into a full-size update, so trajectories that are each
    right to rounding drift apart step by step. The compiled model still reads weights written
    in place between its calls."""
    torch._dynamo.reset()
    eager, kind = build(family)
    eager.train()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    cast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)  # noqa: E731
    for step, size in enumerate([2, 2, 3]):
        inputs = batch(kind, size, step)
        losses = []
        for fn in (eager, compiled):
            with cast():
                loss = fn(**inputs).loss
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0], **tol, msg=lambda m, s=step: f"step {s} loss: {m}")
        if not autocast:  # bf16 gradients differ by roundings, the loss bounds them
            _grads_close(eager, model)
        for (name, b), cb in zip(eager.named_buffers(), model.buffers()):
            if b.is_floating_point():
                torch.testing.assert_close(cb, b, **tol, msg=lambda m, n=name: f"buffer {n}: {m}")
        opt.step(), opt.zero_grad(), model.zero_grad()
        _start_from(eager, model)
    eager.eval(), model.eval()
    with torch.no_grad(), cast():
        inputs = batch(kind, 2, 7)
        torch.testing.assert_close(compiled(**inputs).logits, eager(**inputs).logits, **tol,
                                   msg=lambda m: f"eval logits: {m}")


def first_step_error(family: str, backend) -> str:
    """The first training step's |loss - eager's| and worst norm-relative gradient error."""
    try:
        torch._dynamo.reset()
        eager, kind = build(family)
        eager.train()
        model = copy.deepcopy(eager)
        inputs = batch(kind, 2, 0)
        e = eager(**inputs).loss
        e.backward()
        c = torch.compile(model, backend=backend)(**inputs).loss
        c.backward()
        norms = {n: p.grad.norm().item() for n, p in eager.named_parameters() if p.grad is not None}
        top = max(norms.values(), default=0.0)
        worst = max(((q.grad - p.grad).norm().item() / norms[n], n)
                    for (n, p), q in zip(eager.named_parameters(), model.parameters())
                    if p.grad is not None and q.grad is not None and norms[n] > 1e-4 * top)
        return f"loss {abs(c.item() - e.item()):.1e}, grad {worst[0]:.1e} ({worst[1]})"
    except Exception as ex:  # noqa: BLE001 -- a row, not a crash of the sweep
        return f"{type(ex).__name__}: {str(ex).strip()[:80]}"


def _message(ex: Exception) -> str:
    return f"{type(ex).__name__}: {' | '.join(str(ex).strip().splitlines()[:3])[:240]}"


def sweep_family(family: str, backend, reference, autocast: bool = False) -> Row:
    t0 = time.perf_counter()
    try:
        model, kind = build(family)
        model(**batch(kind, 2, 0)).loss.backward()
    except Exception as ex:  # noqa: BLE001 -- this transformers cannot build or train it from the tiny config
        return Row(family, "skipped", message=f"eager: {_message(ex)}")
    try:
        train_like_eager(family, backend, autocast)
        return Row(family, "ok", time.perf_counter() - t0)
    except Exception as ex:  # noqa: BLE001
        message = _message(ex)
    try:
        train_like_eager(family, reference, autocast)
        status = "own"
    except Exception:  # noqa: BLE001
        status = "shared"
    errors = f"{_name(backend)}: {first_step_error(family, backend)}; {_name(reference)}: {first_step_error(family, reference)}"
    return Row(family, status, time.perf_counter() - t0, message, errors)


def _name(backend) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="aotgrad")
    ap.add_argument("--reference", default="inductor", help="backend a failing family is re-run under")
    ap.add_argument("--families", default="", help="comma-separated (default: every family of --kinds)")
    ap.add_argument("--kinds", default="causal,mlm,s2s,img")
    ap.add_argument("--autocast", action="store_true", help="bf16 CPU autocast (losses at 2e-2, no gradient check)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import aotgrad  # noqa: F401 -- registers the torch.compile backends

    families = args.families.split(",") if args.families else [
        f for kind in args.kinds.split(",") for f in FAMILIES[kind]]
    rows = []
    for family in families:
        row = sweep_family(family, args.backend, args.reference, args.autocast)
        rows.append(row)
        detail = f" {row.message}" + (f"\n{'':24}first step: {row.first_step}" if row.first_step else "")
        print(f"{family:22s} {row.status:8s} {row.seconds:5.0f}s{detail if row.status != 'ok' else ''}", flush=True)
    counts = {s: sum(r.status == s for r in rows) for s in ("ok", "shared", "own", "skipped")}
    print(f"{len(rows)} families under backend={args.backend!r}: " + ", ".join(f"{n} {s}" for s, n in counts.items())
          + f" (shared: fails under {args.reference!r} too)")
    return 1 if counts["own"] else 0


if __name__ == "__main__":
    sys.exit(main())
