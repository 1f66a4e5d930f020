"""Per-call checks of what Dynamo does not guard, before a backend graph's compiled plan runs.

Dynamo matches an optimizer's parameters and state by identity and `.grad` by presence, so two
things a compiled plan depends on can change behind its guards:

- Input sizes and strides. Inductor's compiled code asserts them, one call per input (85 us for
  the 261 inputs of an AdamW step over GPT-2). Where the shapes are static, the backend compiles
  the forward without those asserts and checks here instead, in one C++ call (torch's
  `TensorGuards`, 18 us for the same inputs).
- Overlap between inputs, when the plan mutates inputs. A plan traced while no two inputs shared
  memory is wrong for a call whose inputs do: a write to one must show in the other. By what held
  at compile time: inputs aliased then (rare), the same aliasing now (`alias_key`); no overlap then
  and sizes fixed by one of the checks above, the tensors' byte ranges are disjoint, in one C++
  call built with the graph (`_disjoint_ranges_kernel`, 2.8 us); otherwise, or where it cannot be
  built, distinct storages, in Python (29 us for the same tensors, 50-60 us when they come cold
  from a training step).

A call that fails a check runs on plans compiled per signature for it (`make_fallback`), so it
gives eager's answer where Inductor's assert would have raised.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import operator
import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import torch_compat
from ..signature.inputs import alias_key, is_wrapper, storage_id

log = logging.getLogger("aotgrad.input_checks")


class InputsChecked:
    """Run the shape-generic plan while the inputs are as it was compiled for, else per signature.

    `check_sizes`: the compiled code does not check input sizes and strides, so check them here.
    `check_aliasing`: the plan mutates inputs, so check their overlap. `sizes_fixed`: the shapes
    are static and checked before any kernel runs (here, or by Inductor's asserts), so byte
    ranges computed now hold at every call that gets that far."""

    def __init__(self, run: Callable, leaves: list, make_fallback: Callable, *,
                 check_sizes: bool, check_aliasing: bool, sizes_fixed: bool):
        self.run, self.key, self.make_fallback = run, alias_key(leaves), make_fallback
        self.fallback = None
        self.tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.pick = _picker(self.tensors, len(leaves))
        self.sizes = _SizesCheck(leaves, self.tensors) if check_sizes else None
        # No two inputs shared memory at compile time (the common case): "all storages distinct"
        # is then the same check as comparing alias keys, at a fifth of the cost.
        self.check_aliasing = check_aliasing
        self.distinct = None if self.key else [
            i for i in self.tensors if leaves[i].layout is torch.strided and not is_wrapper(leaves[i])
        ]
        self.disjoint = self.extents = self.build = None
        if check_aliasing and sizes_fixed and _ranges_decide(self.distinct, run.plan):
            self.extents = torch.tensor([byte_extent(leaves[i]) for i in self.distinct], dtype=torch.int64)
            self.build = _disjoint_ranges_kernel(len(self.distinct))
            if len(self.distinct) != len(self.tensors):
                self.pick_distinct = operator.itemgetter(*self.distinct)
            else:
                self.pick_distinct = self.pick

    def __call__(self, leaves) -> Any:
        if self.sizes is not None and not self.sizes.check(self.pick(leaves)):
            return self._per_signature(leaves)
        if not self.check_aliasing:
            return self.run(leaves)
        if self.distinct is None:
            same = alias_key(leaves) == self.key
        else:
            if self.disjoint is None and self.build is not None and self.build.done():
                self.disjoint, self.build = self.build.result(), None
            if self.disjoint is not None:
                try:
                    self.disjoint(self.extents, *self.pick_distinct(leaves))
                    return self.run(leaves)
                except RuntimeError:  # overlap, or a tensor without data: the storage check decides
                    pass
            same = len({storage_id(leaves[i]) for i in self.distinct}) == len(self.distinct)
        if same:
            return self.run(leaves)
        return self._per_signature(leaves)

    def _per_signature(self, leaves) -> Any:
        if self.fallback is None:
            self.fallback = self.make_fallback()
        return self.fallback(leaves)


class _SizesCheck:
    """Sizes and strides of the tensor inputs against the compile-time ones, in one C++ call.

    torch's `TensorGuards` (what Dynamo's tensor guards are made of) also compares dtype, device,
    `requires_grad` and dispatch keys; it takes those from the tensors it is built with, and the
    dispatch keys depend on thread-local state that differs inside a compile. So it is built at
    the first call, from that call's tensors once their dtypes and devices match the compile-time
    ones, with the compile-time sizes and strides."""

    def __init__(self, leaves: list, positions: list[int]):
        self.meta = [(leaves[i].dtype, leaves[i].device.type) for i in positions]
        self.sizes = [list(leaves[i].shape) for i in positions]
        self.strides = [list(leaves[i].stride()) for i in positions]
        self.guards = None

    def check(self, tensors) -> bool:
        guards = self.guards
        if guards is None:
            if [(t.dtype, t.device.type) for t in tensors] != self.meta:
                return False
            from torch._C._dynamo.guards import TensorGuards

            guards = self.guards = TensorGuards(
                *tensors, dynamic_dims_sizes=self.sizes, dynamic_dims_strides=self.strides)
        return guards.check(*tensors)


@functools.cache
def tensor_guards_check_sizes() -> bool:
    """Whether torch's `TensorGuards` is here and rejects other sizes and strides (`_SizesCheck`
    needs it; without it, the backend leaves Inductor's asserts in)."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        a, b = torch.zeros(2, 3), torch.zeros(3)
        guards = TensorGuards(a, b, dynamic_dims_sizes=[[2, 3], [3]], dynamic_dims_strides=[[3, 1], [1]])
        other_strides = torch.zeros(3, 2).t()  # the sizes of `a`, other strides
        return (guards.check(a, b) and not guards.check(other_strides, b) and not guards.check(a, torch.zeros(4))
                and not guards.check(a.t(), b))
    except Exception as e:  # another torch: keep Inductor's asserts
        log.debug("aotgrad: TensorGuards unusable (%s: %s)", type(e).__name__, e)
        return False


def _ranges_decide(distinct: list[int] | None, plan) -> bool:
    """Whether disjoint byte ranges are enough for the plan, with byte ranges fixed at compile time.

    Why that is sound: a plan that only writes input data (no metadata or storage mutation) computes
    the same whatever storage each input lies in, as long as no byte is shared: what a compiled
    graph reads and writes of an input lies within its range. The ranges are computed from the
    compile-time sizes and strides, so they must be fixed: static shapes, checked before any kernel
    runs (by `_SizesCheck`, or by Inductor's input asserts; Dynamo guards the sizes of ordinary
    inputs but not those of an optimizer's parameters, state and gradients).
    """
    return distinct is not None and len(distinct) >= 2 and not any(m.metadata or m.storage for m in plan.mutations)


def byte_extent(t: torch.Tensor) -> int:
    """Bytes from a strided tensor's first element to just past its last one (0 when empty)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _picker(positions: list[int], n: int) -> Callable:
    """The leaves at `positions`, as a sequence, as cheaply as possible."""
    if positions == list(range(n)):
        return lambda leaves: leaves
    if not positions:
        return lambda leaves: ()
    if len(positions) == 1:
        return lambda leaves: (leaves[positions[0]],)
    return operator.itemgetter(*positions)


# One build per number of tensors, shared by every graph of that size; one at a time.
_builds: dict[int, concurrent.futures.Future] = {}
_one_build_at_a_time = threading.Lock()


def _disjoint_ranges_kernel(n: int) -> concurrent.futures.Future:
    """A future of `check(extents, *tensors)`, which raises RuntimeError when two of the `n`
    tensors' byte ranges overlap (None where it cannot be built).

    It is C++ because reading a few hundred data pointers from Python costs more (14 us) than the
    whole check in C++ (2.8 us). Inductor's toolchain builds it (`CppPythonBindingsCodeCache`, which
    reads a tensor's data pointer in C++ without torch's headers): a second of compiler time,
    once per number of tensors, loaded from Inductor's disk cache at once in later runs. (Scalar
    code: built without Inductor's probe of the CPU's vector ISA, which costs 8-12 s more.)
    The build is part of the compile (the caller waits for it): built in the background, it ran on
    the user's first training steps instead (on 2 cores, `make demo-distributed`'s DDP steps were
    2x slower for its first 20 steps, issue 40). It runs in its own thread, outside whatever modes
    the compiling thread has on (its self-test makes real tensors); that thread is not a daemon: a
    script that ends during a build waits for it (a daemon thread stopped at exit inside torch's
    C++ aborts the process).
    """
    future = _builds.get(n)
    if future is None:
        future = _builds[n] = concurrent.futures.Future()

        def build():
            with _one_build_at_a_time:
                kernel = _build_disjoint_ranges_kernel(n)
            if kernel is None:  # a later graph tries again (the cache directory may have gone)
                _builds.pop(n, None)
            future.set_result(kernel)

        threading.Thread(target=build, name=f"aotgrad-overlap-check-{n}", daemon=False).start()
    concurrent.futures.wait([future])
    return future


def wait_for_builds() -> None:
    """Wait until the overlap-check builds have finished (each compile waits for its own already;
    kept for benchmarks and tests that check nothing is left running)."""
    concurrent.futures.wait(list(_builds.values()))


def _build_disjoint_ranges_kernel(n: int) -> Callable | None:
    """The compiled check if it builds and finds an overlap it is shown, else None."""
    try:
        kernel = compile_disjoint_ranges_kernel(n)
        tensors = [torch.zeros(4) for _ in range(n)]
        extents = torch.full((n,), 16, dtype=torch.int64)
        kernel(extents, *tensors)  # disjoint: passes
        try:
            kernel(extents, *tensors[:-1], tensors[0][1:])
        except RuntimeError:
            return kernel
        log.debug("aotgrad: the overlap check built for %d tensors missed an overlap; not used", n)
    except Exception as e:  # no C++ toolchain, another Inductor: the storage check stays
        log.debug("aotgrad: no C++ overlap check for %d tensors (%s: %s)", n, type(e).__name__, e)
    return None


def compile_disjoint_ranges_kernel(n: int) -> Callable:
    # Sorting the ranges by address is most of the cost, and the order rarely changes from call to
    # call: first check them in the last call's order (a permutation of all n, so any order proves
    # disjointness if it finds each range starting past the end of the one before), sort if not.
    source = f"""
        #include <algorithm>
        #include <cstdint>
        #include <stdexcept>
        #include <utility>

        extern "C" void kernel(const int64_t* extent, {", ".join(f"const void* p{i}" for i in range(n))}) {{
            constexpr int n = {n};
            const void* const pointer[n] = {{{", ".join(f"p{i}" for i in range(n))}}};
            thread_local int order[n];
            thread_local bool ordered = false;
            if (ordered) {{
                uintptr_t end = 0;
                int k = 0;
                for (; k < n; ++k) {{
                    const int i = order[k];
                    if (extent[i] <= 0) continue;
                    const uintptr_t start = reinterpret_cast<uintptr_t>(pointer[i]);
                    if (start < end) break;
                    end = start + static_cast<uintptr_t>(extent[i]);
                }}
                if (k == n) return;
            }}
            ordered = false;
            std::pair<uintptr_t, int> range[n];
            for (int i = 0; i < n; ++i) range[i] = {{reinterpret_cast<uintptr_t>(pointer[i]), i}};
            std::sort(range, range + n);
            uintptr_t end = 0;
            for (int k = 0; k < n; ++k) {{
                const int i = order[k] = range[k].second;
                if (extent[i] <= 0) continue;
                if (range[k].first < end) throw std::runtime_error("inputs overlap");
                end = range[k].first + static_cast<uintptr_t>(extent[i]);
            }}
            ordered = true;
        }}
    """
    return torch_compat.load_scalar_cpp_binding(["const int64_t*"] + ["const void*"] * n, source)
