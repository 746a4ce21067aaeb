"""Serving many tasks from one base: a ``DeltaSwitch`` switch against reloading the model and KerasHub's LoRA load.

One process per model. On the Gemma-shaped KerasHub causal LM of
``llm_memory.py`` (152 M parameters by default) three deltas of 1 % of
every kernel's elements (drawn at random, a different draw per task) are
made with ``Freezer.save_delta``; on the bundled text model the same at
``--fraction``. Then, in interleaved rounds after a warm-up, the median
and spread (min..max) of:

- ``switch``: ``DeltaSwitch.use`` from one task to the next (the first
  task's elements written back, the next one's written in), in place;
- ``reload``: ``keras.models.load_model`` of the base ``.keras`` file (what
  serving a task from its own file costs; a delta applied after it costs
  more);
- ``lora``: KerasHub's ``backbone.load_lora_weights`` of an adapter of
  about the delta's size (rank chosen so), on a LoRA-enabled copy (LLM
  only: the bundled model is no KerasHub backbone).

Memory: ``held`` is what the switch keeps (its deltas, sparse, as read:
resident memory before and after it is made; ``kept``: the base's values
under each delta, kept after its first use); ``extra`` is the most a
switch adds while it runs (peak resident memory over 20 switches, counted
from the memory in use before them: ``llm_memory.restart_peak``), against
the delta's size (its values and indices). ``exact``: after every timed
switch the model equals a fresh ``load_delta`` of that task onto the base
(checked on the last round), and ``use(None)`` gives the base back bit for
bit.

    python benchmarks/delta_switch.py                       # the 152 M LLM
    python benchmarks/delta_switch.py --model bundled --fraction 0.05
    KERAS_BACKEND=jax python benchmarks/delta_switch.py --size tiny
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from llm_memory import SIZES, build, peak_mb, restart_peak  # noqa: E402

TASKS = 3


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def kernels(model):
    return [v for v in model.weights if v.path.endswith(("/kernel", "/embeddings")) and "lora" not in v.path]


def make_deltas(model, fraction: float, workdir: str) -> tuple[list[str], int]:
    """``TASKS`` deltas, each ``fraction`` of every kernel's elements moved by a small step; the model stays the base."""
    import numpy as np

    import finefreeze as ff

    paths, elements = [], 0
    for k in range(TASKS):
        rng = np.random.default_rng(10 + k)
        masks = {v.path: rng.random(v.shape) < fraction for v in kernels(model)}
        frz = ff.Freezer(
            model, ff.Plan([ff.freeze("**"), *(ff.train(p, mask=m) for p, m in masks.items())]), gradients="dense"
        )
        originals = {}
        for v in kernels(model):
            originals[v.path] = np.array(v.numpy(), copy=True)
            v.assign(
                np.where(masks[v.path], originals[v.path] + np.asarray(0.01 * (k + 1), v.dtype), originals[v.path])
            )
        paths.append(os.path.join(workdir, f"task{k}.safetensors"))
        frz.save_delta(paths[-1])
        elements = max(elements, int(sum(m.sum() for m in masks.values())))
        for v in kernels(model):
            v.assign(originals[v.path])
        del frz, originals
        gc.collect()
    return paths, elements


def lora_copy(size: str, dtype: str, elements: int, workdir: str):
    """A LoRA-enabled copy of the LLM with an adapter of about ``elements`` values, and the adapter's file."""
    import numpy as np

    def adapter_size(backbone) -> int:
        return sum(int(np.prod(v.shape)) for v in backbone.weights if "lora" in v.path)

    _, probe = build(size, dtype)
    probe.enable_lora(1)
    rank = max(1, round(elements / adapter_size(probe)))  # adapters grow linearly with the rank
    del probe
    _, backbone = build(size, dtype)
    backbone.enable_lora(rank)
    path = os.path.join(workdir, "adapter.lora.h5")
    backbone.save_lora_weights(path)
    return backbone, path, rank, adapter_size(backbone)


def same(model, want) -> bool:
    import numpy as np

    return all(np.array_equal(w.numpy(), v) for w, v in zip(model.weights, want))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llm", choices=["llm", "bundled"])
    ap.add_argument("--size", default="152m", choices=list(SIZES))
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--fraction", type=float, default=0.01)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()

    import keras
    import numpy as np

    import finefreeze as ff
    from finefreeze._data.text_model import build_text_model

    workdir = tempfile.mkdtemp(prefix="delta-switch-")
    if a.model == "llm":
        model, backbone = build(a.size, a.dtype)
        saved = backbone  # the causal LM's weights are its backbone's (the logits reuse the embedding)
        what = f"Gemma-shaped causal LM '{a.size}' ({model.count_params():,} parameters, {a.dtype})"
    else:
        model = saved = build_text_model()
        what = f"bundled text model ({model.count_params():,} parameters)"
    base_file = os.path.join(workdir, "base.keras")
    saved.save(base_file)
    paths, elements = make_deltas(model, a.fraction, workdir)
    base = [np.array(w.numpy(), copy=True) for w in model.weights]
    delta_mb = max(os.path.getsize(p) for p in paths) / 2**20

    restart_peak()
    before = rss_mb()
    switch = ff.DeltaSwitch(model, {f"task{k}": p for k, p in enumerate(paths)})
    restart_peak()  # freed pages handed back: what the switch holds, not what reading the files left free
    held = rss_mb() - before
    for k in range(TASKS):  # warm-up: every write traced or compiled once (JAX compiles one scatter per shape)
        switch.use(f"task{k}")
    switch.use(None)
    held_after = rss_mb()
    restart_peak()
    start = rss_mb()
    for i in range(20):
        switch.use(f"task{i % TASKS}")
    extra = peak_mb() - start
    kept = held_after - before - held  # the base's values kept per delta after its first use
    switch.use(None)
    exact = same(model, base)

    if a.model == "llm":
        lora_backbone, adapter, rank, lora_n = lora_copy(a.size, a.dtype, elements, workdir)
        lora_backbone.load_lora_weights(adapter)  # warm-up

    keras.models.load_model(base_file, compile=False)  # warm-up
    times = {"switch": [], "reload": [], "lora": []}
    for r in range(a.rounds):
        name = f"task{r % TASKS}"
        t = time.perf_counter()
        switch.use(name)
        times["switch"].append(time.perf_counter() - t)
        if a.model == "llm":
            t = time.perf_counter()
            lora_backbone.load_lora_weights(adapter)
            times["lora"].append(time.perf_counter() - t)
        t = time.perf_counter()
        reloaded = keras.models.load_model(base_file, compile=False)
        times["reload"].append(time.perf_counter() - t)
        del reloaded
        gc.collect()
    fresh = build(a.size, a.dtype)[0] if a.model == "llm" else build_text_model()
    ff.load_delta(fresh, paths[(a.rounds - 1) % TASKS])
    exact = exact and same(model, [w.numpy() for w in fresh.weights])
    switch.use(None)
    exact = exact and same(model, base)

    def show(xs):
        return f"{statistics.median(xs) * 1e3:9.1f} ms ({min(xs) * 1e3:.1f}..{max(xs) * 1e3:.1f})"

    print(f"{what}; backend {keras.backend.backend()}; {TASKS} deltas of {a.fraction:.0%} of every kernel")
    print(
        f"delta: {elements:,} elements, {delta_mb * 1024:,.0f} KiB on disk; switch holds {held:.1f} MB "
        f"(+{kept:.1f} MB kept once every delta was used); a switch adds at most {extra:.1f} MB"
    )
    print(f"switch  {show(times['switch'])}")
    print(
        f"reload  {show(times['reload'])}   switch / reload = {statistics.median(times['switch']) / statistics.median(times['reload']):.4f}"
    )
    if times["lora"]:
        print(
            f"lora    {show(times['lora'])}   (KerasHub load_lora_weights, rank {rank}: {lora_n:,} values)  switch / lora = {statistics.median(times['switch']) / statistics.median(times['lora']):.3f}"
        )
    print(f"extra / delta size = {extra / delta_mb:.2f}; exact: {exact}")


if __name__ == "__main__":
    main()
