"""Train a small GPT-2 (transformers.GPT2LMHeadModel, random init, no download) on a public-domain
text that ships in the repo, three ways: eager, torch.compile(backend="aotgrad") and upstream
torch.compile(backend="inductor"), from the same seed, weights and batches.

    python examples/train_gpt2.py                      # 250 steps of 8x64 bytes per variant: ~3-5 minutes on 2 cores
    python examples/train_gpt2.py --steps 40 --plot loss.png

Needs `transformers` (pip install transformers). Dropout is off so the three runs compute the same
function; the check: aotgrad's loss within --tolerance (1e-3) of eager's at each of the first 50 steps,
and its mean loss over the last 10% of steps within 5% of eager's (training amplifies float rounding).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import trainer  # noqa: E402


def make_gpt2(n_layer: int = 4, n_embd: int = 256, n_head: int = 4, n_positions: int = 128):
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    cfg = GPT2Config(
        vocab_size=256,  # bytes
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg)
    model.train()
    return model


def gpt2_logits(model, x):
    return model(input_ids=x).logits


def main(argv=None) -> int:
    p = trainer.parser(__doc__.splitlines()[0], steps=250, batch=8, seq=64, lr=2e-3)
    args = p.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("examples/train_gpt2.py needs transformers: pip install transformers")
        return 2
    return trainer.main_with(args, "GPT-2 (4 layers, 256 wide, 4 heads, byte vocab)", make_gpt2, gpt2_logits)


if __name__ == "__main__":
    raise SystemExit(main())
