"""A sweep of ~100 transformers families (tiny configs, CPU): does each train like eager under
`torch.compile(backend=BACKEND)`, and where it does not, does the reference backend fail the same way?

Per family: a tiny config of the family's causal-LM, masked-LM, seq2seq or image-classification
model (dropout, drop-path, layer drop and router jitter zeroed), three AdamW steps (batches of 2, 2
and 3: the third recompiles; each step starts both from eager's weights) and an eval forward, every
loss, gradient and float buffer against eager's. A family that misses fp32 eager gets a second
check: the same steps beside an fp64 eager copy, torch's benchmark accuracy rule (`fp64_check`);
passing it, the row says *fp64* (under --autocast the allowance is bf16 eager's error from fp64).
Otherwise the family is re-run under REFERENCE, and the row says whether the failure is *shared* or
aotgrad's *own*, with each backend's worst tensor against fp64. Each family runs in a child
process: one whose process dies (a compiled kernel corrupting the heap) is a row, re-run alone under
REFERENCE. Exits 1 if a family fails under BACKEND alone.

    make sweep-hf                                              # aotgrad vs inductor, every family
    python benchmarks/hf_family_sweep.py --backend aotgrad_eager --reference aot_eager --kinds img
    python benchmarks/hf_family_sweep.py --autocast --families gpt_neox,bert   # bf16 autocast, looser

Families the installed transformers cannot build, or train eagerly, from the tiny config are listed
as skipped; so is one whose eager loss changes with the seed (a random rate left on).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import subprocess
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
            "longformer"],
    "tok": ["canine"],  # no masked-LM head: a token-classification one
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
         "prophetnet": ("num_hidden_layers", "encoder_layers", "decoder_layers", "encoder_attention_heads",
                        "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim"),  # its own names
         "deepseek_v3": ("head_dim", "partial_rotary_factor", "rotary_dim")}  # its own q/k/v head sizes
_SET = {"funnel": dict(block_sizes=[1, 1], d_head=16, n_head=4, d_inner=128),
        "prophetnet": dict(num_encoder_layers=1, num_decoder_layers=1, num_encoder_attention_heads=4,
                           num_decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, ngram=2,
                           num_buckets=8, relative_max_distance=16),
        "dbrx": dict(n_heads=4, n_layers=2, max_seq_len=64,
                     attn_config=dict(rope_theta=10000.0, kv_n_heads=2, clip_qkv=8.0),
                     ffn_config=dict(ffn_hidden_size=128, moe_num_experts=4, moe_top_k=2)),
        "deepseek_v3": dict(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=32,
                            n_routed_experts=4, moe_intermediate_size=64, first_k_dense_replace=1, n_group=1,
                            topk_group=1)}
# Image families: their own configs shrunk to the text families' size (the defaults are full models,
# up to EfficientNet-B7's 64M parameters); mobilenet_v1 and v2 are small as they are.
_VIT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, patch_size=8)
_STAGES = dict(hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1])
_WINDOWS = dict(embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=4)
_SET.update({vit: _VIT for vit in ("vit", "deit", "beit", "dinov2", "data2vec-vision", "vit_msn")})
_SET.update({fam: _STAGES for fam in ("convnext", "convnextv2", "poolformer")})
_SET.update({"swin": _WINDOWS, "swinv2": _WINDOWS,
             "regnet": dict(_STAGES, embedding_size=16, groups_width=8),
             "resnet": dict(_STAGES, embedding_size=16),
             "bit": dict(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], embedding_size=32, num_groups=8),
             "pvt": dict(_STAGES, num_attention_heads=[1, 2, 4, 8]),
             "focalnet": dict(embed_dim=16, depths=[1, 1], focal_levels=[2, 2], focal_windows=[3, 3]),
             "efficientnet": dict(width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320),
             "cvt": dict(embed_dim=[16, 32, 64], num_heads=[1, 2, 4], depth=[1, 2, 3]),  # stage i reads rate i
             "hiera": dict(image_size=[32, 32], embed_dim=16, depths=[1, 1, 1, 1]),
             "levit": dict(hidden_sizes=[32, 64, 96], num_attention_heads=[2, 4, 6], depths=[1, 1, 1], key_dim=[8] * 3),
             "mobilevit": dict(hidden_sizes=[32, 48, 64], neck_hidden_sizes=[8, 16, 24, 32, 40, 48, 128]),
             "textnet": dict(stem_out_channels=16, hidden_sizes=[16, 16, 32, 64, 128])})
_RANDOM = ("dropout", "pdrop", "drop_path", "layerdrop", "jitter")  # config floats zeroed: eager must be repeatable


@dataclass
class Row:
    family: str
    status: str  # "ok"; "fp64" (off fp32 eager, as close to fp64 eager as it); "shared" (the reference
    #              fails both checks too); "own"; "skipped" (eager cannot build or train it)
    seconds: float = 0.0
    message: str = ""
    detail: str = ""  # for failures: each backend against fp64 eager (fp64_check), or the reference alone


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
        if any(word in k for word in _RANDOM) and isinstance(v, (float, list, tuple)):  # CvT: a tuple, per stage
            setattr(cfg, k, 0.0 if isinstance(v, float) else type(v)(0.0 if isinstance(x, float) else x for x in v))
    cfg.use_cache = False
    auto = dict(causal=transformers.AutoModelForCausalLM, mlm=transformers.AutoModelForMaskedLM,
                s2s=transformers.AutoModelForSeq2SeqLM, tok=transformers.AutoModelForTokenClassification,
                img=transformers.AutoModelForImageClassification)[kind]
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
    labels = torch.randint(1, V, (size, 8), generator=g) if kind == "s2s" else tokens % 10 if kind == "tok" else tokens
    return dict(input_ids=tokens, labels=labels)


def _grads_close(rows) -> None:
    """Each parameter's gradient at its own scale (tests/helpers.assert_grads_close's rule);
    rows are (name, compiled's gradient, eager's, ...)."""
    largest = lambda g: g.abs().max().item() if g.numel() else 0.0  # noqa: E731 -- MobileBERT has empty parameters
    scale = max((largest(e) for _, _, e, *_ in rows if e is not None), default=0.0)
    for name, c, e, *_ in rows:
        if (e is None) != (c is None):
            raise AssertionError(f"{name}: eager's gradient is {e is None and 'None' or 'a tensor'}")
        if e is not None:
            atol = max(1e-4 * largest(e), 1e-6 * scale, 1e-12)
            torch.testing.assert_close(c, e, rtol=1e-3, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def _start_from(eager: torch.nn.Module, model: torch.nn.Module) -> None:
    """Writes eager's weights and buffers into the compiled model's own tensors, in place."""
    with torch.no_grad():
        for theirs, ours in zip([*eager.parameters(), *eager.buffers()], [*model.parameters(), *model.buffers()]):
            ours.copy_(theirs)


def _checks(family: str, backend, autocast: bool = False, fp64: bool = False):
    """Three AdamW steps and an eval forward, compiled and eager (and an fp64 eager copy); yields
    each check as (what, [(name, compiled, eager, fp64 or None), ...]) as soon as it is computed.

    Each step starts every model from eager's weights and buffers: AdamW turns a rounding-sized
    difference in a near-zero gradient into a full-size update, so trajectories that are each
    right to rounding drift apart step by step. The compiled model still reads weights written
    in place between its calls."""
    torch._dynamo.reset()
    eager, kind = build(family)
    eager.train()
    model = copy.deepcopy(eager)
    ref = copy.deepcopy(eager).double() if fp64 else None
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    # the fp64 copy runs without autocast: it is the exact answer both bf16 runs are measured from
    cast = lambda in64=False: torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast and not in64)  # noqa: E731
    double = lambda inputs: {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}  # noqa: E731
    runs = [(eager, False), (compiled, False)] + ([(ref, True)] if fp64 else [])
    params = lambda m: [(n, p.grad) for n, p in m.named_parameters()] if m is not None else None  # noqa: E731
    buffers = lambda m: [(n, b) for n, b in m.named_buffers() if b.is_floating_point()] if m is not None else None  # noqa: E731, E501
    for step, size in enumerate([2, 2, 3]):
        inputs = batch(kind, size, step)
        losses = []
        for fn, in64 in runs:
            with cast(in64):
                loss = fn(**(double(inputs) if in64 else inputs)).loss
            loss.backward()
            losses.append(loss.detach().reshape(1))
        yield f"step {step} loss", [("", losses[1], losses[0], losses[2] if fp64 else None)]
        yield f"step {step} gradients", _zip(params(eager), params(model), params(ref))
        yield f"step {step} buffers", _zip(buffers(eager), buffers(model), buffers(ref))
        opt.step(), opt.zero_grad(), model.zero_grad()
        for other in (model, ref):
            if other is not None:
                other.zero_grad(), _start_from(eager, other)
    for m in (eager, model, ref):
        if m is not None:
            m.eval()
    inputs = batch(kind, 2, 7)
    with torch.no_grad():
        with cast():
            logits = [compiled(**inputs).logits, eager(**inputs).logits]
        with cast(True):
            logits.append(ref(**double(inputs)).logits if fp64 else None)
    yield "eval logits", [("", *logits)]


def _zip(eager, model, ref):
    return [(name, c, e, ref[i][1] if ref is not None else None) for i, ((name, e), (_, c)) in enumerate(zip(eager, model))]


def train_like_eager(family: str, backend, autocast: bool = False) -> None:
    """Raises at the first check where the compiled model differs from eager (`_checks`)."""
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    for what, rows in _checks(family, backend, autocast):
        if what.endswith("gradients"):
            if not autocast:  # bf16 gradients differ by roundings, the loss bounds them
                _grads_close(rows)
            continue
        for name, c, e, _ in rows:
            where = f"{what} {name}".strip()
            torch.testing.assert_close(c, e, **tol, msg=lambda m, w=where: f"{w}: {m}")


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).pow(2).mean().sqrt().item() if a.numel() else 0.0


def fp64_check(family: str, backend, autocast: bool = False) -> tuple[bool, str]:
    """The same steps against an fp64 eager copy: is BACKEND as close to it as eager is (fp32, or
    bf16 under AUTOCAST: Inductor misses funnel's bf16 eval logits at 2e-2 as aotgrad does)?

    torch's benchmark accuracy rule (`torch._dynamo.utils.same` with `fp64_ref`): per tensor (each
    loss, gradient, float buffer and the eval logits) the backend's RMSE from fp64 is at most twice
    fp32 eager's (three times under 1000 elements), plus a floor of 1e-6 of the largest value of
    the check (upstream adds an absolute 1e-3, which would pass a backend 0.1% off). It tells a
    backend that reorders sums in an ill-conditioned model (BatchNorm over two values per channel)
    from a wrong one. Returns whether it passes and the worst tensor."""
    worst = (0.0, "", 0.0, 0.0)  # (excess over the allowance, where, backend's RMSE, eager's)
    try:
        for what, rows in _checks(family, backend, autocast, fp64=True):
            if any((c is None) != (e is None) for _, c, e, _ in rows):
                return False, f"{what}: a gradient is None in one of eager and the backend only"
            rows = [row for row in rows if row[1] is not None]
            top = max((r.abs().max().item() for *_, r in rows if r.numel()), default=0.0)
            for name, c, e, r in rows:
                res, base = _rmse(c, r), _rmse(e, r)
                allowed = (3.0 if r.numel() < 1000 else 2.0) * base + 1e-6 * top
                worst = max(worst, ((res - allowed) / max(top, 1e-30), f"{what} {name}".strip(), res, base))
    except Exception as ex:  # noqa: BLE001 -- a row, not a crash of the sweep
        return False, f"{type(ex).__name__}: {str(ex).strip()[:80]}"
    excess, where, res, base = worst
    precision = "bf16" if autocast else "fp32"
    if excess <= 0:
        return True, f"every tensor within 2-3x {precision} eager's error from fp64"
    return False, f"{where}: RMSE from fp64 {res:.1e}, {precision} eager's {base:.1e}"


def _message(ex: Exception) -> str:
    return f"{type(ex).__name__}: {' | '.join(str(ex).strip().splitlines()[:3])[:240]}"


def _seeded_loss(model: torch.nn.Module, inputs: dict, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return model(**inputs).loss


def sweep_family(family: str, backend, reference, autocast: bool = False, on_own_failure=None) -> Row:
    """The family's row. `on_own_failure(row)` hears of a failure of BACKEND's own (status
    "failing") before REFERENCE runs: a reference that then does not end (funnel under Inductor)
    must not hide which check BACKEND failed."""
    t0 = time.perf_counter()
    try:  # under the sweep's autocast too: a model whose eager step fails under it is not a backend's row
        model, kind = build(family)
        inputs = batch(kind, 2, 0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            losses = [_seeded_loss(model, inputs, seed) for seed in (1, 2)]
        losses[0].backward()
    except Exception as ex:  # noqa: BLE001 -- this transformers cannot build or train it from the tiny config
        return Row(family, "skipped", message=f"eager: {_message(ex)}")
    if not torch.equal(losses[0].detach(), losses[1].detach()):  # CvT's per-stage drop-path rate did this
        return Row(family, "skipped", message="eager: its training loss depends on the RNG (a random rate "
                   f"the tiny config left on): {losses[0].item():.6g} and {losses[1].item():.6g} under two seeds")
    try:
        train_like_eager(family, backend, autocast)
        return Row(family, "ok", time.perf_counter() - t0)
    except Exception as ex:  # noqa: BLE001
        message = _message(ex)
    passes, verdict = fp64_check(family, backend, autocast)
    if passes:
        return Row(family, "fp64", time.perf_counter() - t0, message, f"against fp64: {_name(backend)}: {verdict}")
    if on_own_failure is not None:
        on_own_failure(Row(family, "failing", time.perf_counter() - t0, message,
                           f"against fp64: {_name(backend)}: {verdict}"))
    try:
        train_like_eager(family, reference, autocast)
        reference_passes, reference_verdict = True, "trains like eager"
    except Exception:  # noqa: BLE001
        reference_passes, reference_verdict = fp64_check(family, reference, autocast)
    status = "own" if reference_passes else "shared"
    fp64 = f"against fp64: {_name(backend)}: {verdict}; {_name(reference)}: {reference_verdict}"
    return Row(family, status, time.perf_counter() - t0, message, fp64)


def _name(backend) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))


_ROW = "hf_family_sweep row: "  # the line a child process reports its row on


FAMILY_TIMEOUT_S = 900


def _child(command: list[str], timeout_s: float = FAMILY_TIMEOUT_S) -> tuple[Row | None, str]:
    """Run one family's sweep in a child process: its row and "", or its provisional "failing" row
    (or None) and why the process died or was stopped after `timeout_s` (funnel's compile sits in
    Inductor's C++ tiling for over 15 min)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as ex:  # its output so far is bytes, whatever `text` says
        out = ex.stdout.decode(errors="replace") if isinstance(ex.stdout, bytes) else ex.stdout or ""
        return _last_row(out), f"no row after {timeout_s:.0f} s (stopped)"
    row = _last_row(done.stdout)
    if row is not None and row.status != "failing":
        return row, ""
    last = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:] or ["no output"]
    return row, f"process died (exit {done.returncode}): {last[0][:160]}"


def _last_row(stdout: str) -> Row | None:
    """The last row a child printed: its final one, or the provisional "failing" one it printed
    before running the reference."""
    rows = [line[len(_ROW):] for line in stdout.splitlines() if line.startswith(_ROW)]
    return Row(**json.loads(rows[-1])) if rows else None


def sweep_family_isolated(family: str, backend: str, reference: str, autocast: bool = False,
                          timeout_s: float = FAMILY_TIMEOUT_S) -> Row:
    """`sweep_family` in a child process, so that a crash (a compiled kernel corrupting the heap
    aborts the interpreter) or a compile that does not end is a row, not the end of the sweep. A
    family whose process dies under BACKEND is re-run alone under REFERENCE, with the same time
    limit: *own* if that one trains like eager, else *shared*. One that failed a check of its own
    and then died or was stopped under REFERENCE is *shared*, with BACKEND's failure as its message."""
    t0 = time.perf_counter()
    command = [sys.executable, __file__, "--one", "--families", family, "--reference", reference]
    row, died = _child([*command, "--backend", backend] + (["--autocast"] if autocast else []), timeout_s)
    if row is not None and row.status == "failing":  # BACKEND failed a check; REFERENCE then died or did not end
        return Row(family, "shared", time.perf_counter() - t0, row.message,
                   f"{row.detail}; {_name(reference)}: {died}")
    if row is not None:
        return row
    again, reference_died = _child([*command, "--backend", reference] + (["--autocast"] if autocast else []),
                                   timeout_s)
    status = "own" if again is not None and again.status in ("ok", "fp64") else "shared"
    verdict = reference_died or f"{again.status} {again.message}".strip()
    return Row(family, status, time.perf_counter() - t0, f"{_name(backend)}: {died}",
               f"{_name(reference)} alone: {verdict[:200]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="aotgrad")
    ap.add_argument("--reference", default="inductor", help="backend a failing family is re-run under")
    ap.add_argument("--families", default="", help="comma-separated (default: every family of --kinds)")
    ap.add_argument("--kinds", default="causal,mlm,s2s,tok,img")
    ap.add_argument("--autocast", action="store_true", help="bf16 CPU autocast (losses at 2e-2, no gradient check; a miss is judged against fp64)")
    ap.add_argument("--in-process", action="store_true", help="every family in this process (a crash ends the sweep)")
    ap.add_argument("--family-timeout", type=float, default=FAMILY_TIMEOUT_S,
                    help="seconds a family's child process may run (default %(default)s)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: one family, its row as JSON
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import aotgrad  # noqa: F401 -- registers the torch.compile backends

    families = args.families.split(",") if args.families else [
        f for kind in args.kinds.split(",") for f in FAMILIES[kind]]
    if args.one:
        def report(row):
            print(_ROW + json.dumps(dataclasses.asdict(row)), flush=True)
        report(sweep_family(families[0], args.backend, args.reference, args.autocast, on_own_failure=report))
        return 0
    rows = []
    for family in families:
        if args.in_process:
            row = sweep_family(family, args.backend, args.reference, args.autocast)
        else:
            row = sweep_family_isolated(family, args.backend, args.reference, args.autocast, args.family_timeout)
        rows.append(row)
        detail = f" {row.message}" + (f"\n{'':24}{row.detail}" if row.detail else "")
        print(f"{family:22s} {row.status:8s} {row.seconds:5.0f}s{detail if row.status != 'ok' else ''}", flush=True)
    counts = {s: sum(r.status == s for r in rows) for s in ("ok", "fp64", "shared", "own", "skipped")}
    print(f"{len(rows)} families under backend={args.backend!r}: " + ", ".join(f"{n} {s}" for s, n in counts.items())
          + f" (shared: fails under {args.reference!r} too)")
    return 1 if counts["own"] else 0


if __name__ == "__main__":
    sys.exit(main())
