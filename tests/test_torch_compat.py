"""torch_compat's fallbacks for older torch releases, exercised on this one by hiding the newer name."""

from __future__ import annotations

import torch

from aotgrad import torch_compat

_lib = torch.library.Library("aotgrad_compat_test", "DEF")
_lib.define("write_into(Tensor(a!) out) -> Tensor(a!)", tags=(torch.Tag.out_variant,))
_lib.define("bump(Tensor(a!) x) -> ()")


def test_is_out_asks_torch_where_it_can():
    assert torch_compat.is_out(torch.ops.aten.add.out)
    assert not torch_compat.is_out(torch.ops.aten.add_.Tensor)


def test_is_out_reads_the_out_variant_tag_without_is_out(monkeypatch):
    """torch 2.11 has no `torch._library.utils.is_out`; its out-semantics tag is `out_variant`."""
    monkeypatch.delattr(torch._library.utils, "is_out", raising=False)
    assert torch_compat.is_out(torch.ops.aotgrad_compat_test.write_into.default)
    assert not torch_compat.is_out(torch.ops.aotgrad_compat_test.bump.default)
