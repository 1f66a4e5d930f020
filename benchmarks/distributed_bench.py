"""Scale-out step time: the demo's GPT-2 on 2 ranks under DDP and FSDP2, aotgrad vs upstream Inductor.

    python benchmarks/distributed_bench.py [--steps 20] [--json out.json]

Runs `torchrun --standalone --nproc-per-node 2 examples/train_distributed.py --bench`: in each rank
both variants are built side by side and take turns, one training step each (another first each
step), so both see the same machine. Reported per strategy: median step time (steps after the
first 3; a step ends with the ranks' loss all-reduce) and the ratio aotgrad/inductor (target
<= 1.0x), compile time (first step minus the median), and activation memory per rank: bytes saved
for the backward in one forward on rank 0 (distinct storages, parameters and the batch left out);
on CUDA also the peak allocated during that forward. An eager run of the same strategy steps
alongside (not timed against): each compiled variant's losses (per step, mean over ranks) are
compared with eager's, and with each other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEMO = os.path.join(ROOT, "examples", "train_distributed.py")


def run(steps: int, extra: list[str] | None = None, log=print) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", DEMO,
               "--bench", out, "--steps", str(steps), *(extra or [])]
        log("running: " + " ".join(cmd[1:]))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            return {"error": f"exit code {proc.returncode}: {proc.stderr[-2000:]}"}
        with open(out) as fh:
            return json.load(fh)


def _mb(v) -> str:
    return "-" if v is None else f"{v / 2**20:.2f}"


def _loss_diff(run: dict, eager: dict) -> float:
    """The largest difference between a run's losses (mean over ranks, per step) and eager's."""
    return max(abs(x - y) for x, y in zip(run["losses"], eager["losses"], strict=True))


def report(res: dict) -> list[str]:
    if "error" in res:
        print(f"distributed benchmark FAILED: {res['error']}")
        return [f"scale-out: FAILED ({res['error'][:80]})"]
    print(f"\n== Scale-out: GPT-2 on {res['world']} ranks ({res['device']}), {res['steps']} steps taking turns ==")
    headers = ["strategy", "aotgrad step ms", "inductor step ms", "ratio", "aotgrad compile s",
               "inductor compile s", "saved act MB/rank a|i", "peak MB/rank a|i",
               "max |loss - eager's| a|i", "losses a=i"]
    rows, lines = [], []
    for strategy, r in res["results"].items():
        a, i, e = r["aotgrad"], r["inductor"], r["eager"]
        ratio = a["median_step_s"] / i["median_step_s"]
        da, di = _loss_diff(a, e), _loss_diff(i, e)
        rows.append([strategy, f"{a['median_step_s'] * 1e3:.1f}", f"{i['median_step_s'] * 1e3:.1f}",
                     f"{ratio:.2f}x", f"{a['compile_s']:.1f}", f"{i['compile_s']:.1f}",
                     f"{_mb(a['saved_bytes'])} | {_mb(i['saved_bytes'])}",
                     f"{_mb(a['peak_bytes'])} | {_mb(i['peak_bytes'])}",
                     f"{da:.1e} | {di:.1e}", "identical" if a["losses"] == i["losses"] else "differ"])
        lines.append(f"scale-out {strategy}: step time aotgrad/inductor {ratio:.2f}x (target <= 1.0x); "
                     f"losses over {len(e['losses'])} steps within {da:.1e} of eager's (inductor {di:.1e})")
        if a.get("note"):
            print(f"   note: {a['note']}")
    widths = [max(len(h), *(len(r[k]) for r in rows)) for k, h in enumerate(headers)]
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default=None)
    args, extra = p.parse_known_args(argv)
    res = run(args.steps, extra, log=lambda m: print(m, file=sys.stderr, flush=True))
    for line in report(res):
        print(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
