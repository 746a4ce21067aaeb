"""Peak training memory of partial fine-tunes of a Gemma-shaped KerasHub causal LM, against the floor and full fine-tuning.

The model is a KerasHub ``GemmaBackbone`` built from a config (random
weights: memory and time do not depend on the values) whose logits are the
tied token embedding's reverse projection, ``token_embedding(h,
reverse=True)``; batches of 4 x 128 tokens, next-token loss, Adam.

Variants (trained elements at the default size in brackets):

- ``floor``: every kernel and the embedding frozen, only the norm scales
  train: the whole backward pass and every activation, no kernel gradient;
- ``full``: plain Keras, everything trains;
- ``lora``: KerasHub's ``enable_lora(8)``, plain Keras (the query and value projections);
- ``lora-all``: ``enable_lora(8)`` on every projection ``columns`` trains (query, key, value,
  attention output and the three feed-forward kernels): what LoRA pays where it trains the same
  layers, whose weight gradients need each layer's input kept from the forward pass;
- ``rows``: the tied embedding's last 100 rows (new tokens) and the norms (``--untied``: and the
  output table's last 100 columns);
- ``columns``: 1 % of the output columns (the last axis) of every kernel, and the norms;
- ``columns-qv``: the same of the query and value kernels only (the layers ``lora`` trains);
- ``scattered``: 1 % of the elements of every kernel, drawn at random, and the norms;
- ``scattered-even``: the same, but exactly 1 % of each kernel (drawn without replacement): every
  kernel of one shape has a delta of one length, whose compiled code XLA shares (JAX);
- ``scattered-qv``: the same of the query and value kernels only (the layers ``lora`` trains);
- ``scattered-table``: 1 % of the elements of the tied token embedding, drawn at random (their
  rows are nearly every row: no block of rows is small), and the norms;
- ``fisher``: 1 % of the kernels' elements, chosen by ``ff.select(score="fisher")`` with the
  recipe of docs/llm.md (:data:`SELECT`: the table excluded, ``spread="kind"``);
- ``fisher-columns``: the same budget in whole columns (``structure="columns"``);
- ``select``: the fisher selection itself: its peak, and its time per example after its
  first batch (the selection of one batch is timed first; the first microbatch traces and
  compiles the gradient, as ``step s`` leaves the first step out).

Each variant runs in a process of its own. ``peak MB`` is the training
peak: the process's peak resident memory (``VmHWM``, which on a CPU holds
every backend's buffers) from the first step on, counted from the memory in
use once the model, its plan and the compiled optimizer exist (freed memory
handed back, the peak started over: :func:`restart_peak`). ``plan MB`` is
what making the ``Freezer`` added to the peak before that. ``excess`` is
(peak - floor's peak) / (full's peak - floor's peak): the share of full
fine-tuning's extra memory a variant pays. ``steady MB`` and its excess: the
same peak over the steps after the first (the peak started over after it),
without tracing and compiling the step, which the first step's peak holds
(on a CPU the compiler's memory is the process's). ``exact``: ``Freezer.verify()``
passed (every frozen element bit-identical after the steps) and every
trained element's kernel moved; ``frozen only``: verify passed and some
kernel's trained elements did not move (Keras' ``Adam`` moves no bfloat16
weight: its ``1 - beta_2 ** step`` rounds to 0 in bfloat16).

    python benchmarks/llm_memory.py                        # every variant on this backend
    KERAS_BACKEND=jax python benchmarks/llm_memory.py --only floor,full,columns
    python benchmarks/llm_memory.py --time --rounds 5      # step times, interleaved in one process
    python benchmarks/llm_memory.py --size 1b --dtype bfloat16   # a 1.1 B-parameter config (a GPU's memory)
    python benchmarks/llm_memory.py --size tiny --steps 2        # a smoke test of the script (below)
    python benchmarks/llm_memory.py --untied --quantize int8 --only floor,lora-all,rows   # Llama-shaped, untied

``--untied``: a ``LlamaBackbone`` of the same sizes (no ``head_dim``: hidden / 8 heads, the same 128)
whose logits are its own output table (``tie_word_embeddings=False``, ``reverse_embeddings``).

``--size tiny`` checks that every variant runs; its figures mean nothing:
full fine-tuning is a few MB above the floor (the excess divides by that),
and its kernels are below what ``gradients="auto"`` slices (65,536 elements).
    KERAS_BACKEND=jax python benchmarks/llm_memory.py --xla-memory --only columns,scattered   # XLA's temporaries too
    XLA_FLAGS=--xla_cpu_enable_concurrency_optimized_scheduler=false KERAS_BACKEND=jax \
        python benchmarks/llm_memory.py --quantize int8 --only floor,lora-all,scattered   # XLA's memory-first schedule
    python benchmarks/llm_memory.py --graph-ops --only floor,columns,scattered   # TensorFlow: the traced step's operations
    KERAS_BACKEND=jax python benchmarks/llm_memory.py --jit-compile false --only floor,full,columns   # a step not jitted
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SIZES = {
    "tiny": dict(vocabulary_size=1000, num_layers=2, hidden_dim=64, intermediate_dim=256, head_dim=16),
    "152m": dict(vocabulary_size=32000, num_layers=8, hidden_dim=1024, intermediate_dim=8192, head_dim=128),
    "1b": dict(vocabulary_size=32000, num_layers=18, hidden_dim=2048, intermediate_dim=16384, head_dim=256),
}
VARIANTS = [
    "floor",
    "full",
    "lora",
    "lora-all",
    "rows",
    "columns",
    "columns-qv",
    "scattered",
    "scattered-even",
    "scattered-qv",
    "scattered-table",
    "select",
    "fisher",
    "fisher-columns",
]
NEW_ROWS = 100
FRACTION = 0.01
BATCH, TOKENS = 4, 128
NORMS = ["**/*norm*/scale"]
#: ``select``'s recipe for a decoder LM (docs/llm.md): the table left out, the budget spread over every kind of
#: projection in proportion to its size, the norms trained in full
SELECT = dict(include=NORMS, exclude="**/token_embedding/**", spread="kind")
#: the decoder's projections (every kernel ``columns`` and ``scattered`` train)
PROJECTIONS = ["query", "key", "value", "attention_output", "ffw_gating", "ffw_gating_2", "ffw_linear"]
#: the same of a Llama decoder (``--untied``)
LLAMA_PROJECTIONS = [
    "query", "key", "value", "attention_output",
    "feedforward_gate_dense", "feedforward_intermediate_dense", "feedforward_output_dense",
]  # fmt: skip


def enable_lora(backbone, variant: str) -> None:
    """KerasHub's LoRA of rank 8: on its default layers (``lora``) or on every projection (``lora-all``)."""
    if variant == "lora":
        backbone.enable_lora(8)
    elif variant == "lora-all":
        llama = type(backbone).__name__ == "LlamaBackbone"
        backbone.enable_lora(8, target_layer_names=LLAMA_PROJECTIONS if llama else PROJECTIONS)


def build(size: str, dtype: str, remat: bool = False, untied: bool = False):
    """The Gemma-shaped LM (tied logits; ``untied``: Llama-shaped, its own output table); ``remat``: each
    decoder block rematerialized (``keras.RematScope``)."""
    import contextlib

    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    keras.config.set_dtype_policy(dtype)
    blocks = [f"decoder_block_{i}" for i in range(SIZES[size]["num_layers"])]
    scope = keras.RematScope(mode="list_of_layers", layer_names=blocks) if remat else contextlib.nullcontext()
    with scope:
        if untied:
            config = {k: v for k, v in SIZES[size].items() if k != "head_dim"}
            backbone = keras_hub.models.LlamaBackbone(
                num_query_heads=8, num_key_value_heads=1, tie_word_embeddings=False, **config
            )
        else:
            backbone = keras_hub.models.GemmaBackbone(num_query_heads=8, num_key_value_heads=1, **SIZES[size])
        h = backbone(backbone.input)
        logits = backbone.token_embedding(h, reverse=True)
        model = keras.Model(backbone.input, logits, name="lm")
    return model, backbone


def data(size: str, n: int = BATCH, seed: int = 1):
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = SIZES[size]["vocabulary_size"]
    ids = rng.integers(1, vocab, (n, TOKENS + 1)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((n, TOKENS), "int32")}
    return x, ids[:, 1:]


def kernels(model):
    return [v for v in model.weights if v.path.endswith("/kernel") and "lora" not in v.path]


def lora_default(v) -> bool:
    """Whether ``v`` is a kernel of the layers KerasHub's ``enable_lora`` adapts by default (query and value)."""
    return v.path.split("/")[-2] in ("query", "value")


def plan_for(variant: str, model, size: str, workdir: str):
    """The plan (or None: plain Keras) and the Freezer's ``gradients`` of a variant."""
    import numpy as np

    import finefreeze as ff

    base = [ff.freeze("**"), *(ff.train(s) for s in NORMS)]
    if variant in ("full", "lora", "lora-all"):
        return None
    if variant == "floor":
        return ff.Plan(base)
    if variant == "rows":
        rules = [ff.train(f"token_embedding/embeddings[-{NEW_ROWS}:]")]
        if any(v.path == "token_embedding/reverse_embeddings" for v in model.weights):  # untied: its own columns
            rules.append(ff.train(f"token_embedding/reverse_embeddings[:, -{NEW_ROWS}:]"))
        return ff.Plan(base + rules)
    if variant in ("columns", "columns-qv"):
        rules = []
        for v in kernels(model):
            if variant == "columns-qv" and not lora_default(v):
                continue
            n = max(1, round(FRACTION * v.shape[-1]))
            rules.append(ff.train(f"{v.path}[..., :{n}]"))
        return ff.Plan(base + rules)
    if variant == "scattered-even":  # exactly 1 % of each kernel: kernels of one shape, deltas of one length
        rng = np.random.default_rng(2)
        rules = []
        for v in kernels(model):
            size = int(np.prod(v.shape))
            mask = np.zeros(size, bool)
            mask[rng.choice(size, round(FRACTION * size), replace=False)] = True
            rules.append(ff.train(v.path, mask=mask.reshape(v.shape)))
        return ff.Plan(base + rules)
    if variant in ("scattered", "scattered-qv"):
        rng = np.random.default_rng(2)
        rules = [
            ff.train(v.path, mask=rng.random(v.shape) < FRACTION)
            for v in kernels(model)
            if variant == "scattered" or lora_default(v)
        ]
        return ff.Plan(base + rules)
    if variant == "scattered-table":
        table = next(v for v in model.weights if v.path == "token_embedding/embeddings")
        mask = np.random.default_rng(2).random(table.shape) < FRACTION
        return ff.Plan([*base, ff.train(table.path, mask=mask)])
    if variant in ("fisher", "fisher-columns"):
        return ff.Plan.load(os.path.join(workdir, f"{variant}.json"))
    raise SystemExit(f"unknown variant {variant!r}")


def child(a) -> dict:
    import keras
    import numpy as np

    import finefreeze as ff

    model, backbone = build(a.size, a.dtype, a.remat, a.untied)
    x, y = data(a.size)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    out = {"variant": a.variant, "backend": keras.backend.backend(), "size": a.size, "dtype": a.dtype}
    out["quantize"], out["remat"], out["untied"] = a.quantize, a.remat, a.untied
    out["stages_mb"] = stages = {"built": peak_mb()}
    out["parameters"] = int(sum(np.prod(v.shape) for v in model.weights))
    if a.variant == "select":
        xs, ys = data(a.size, n=a.examples, seed=3)
        model.compile(loss=loss)
        out["peak_reset"] = restart_peak()
        # one batch first: a select's first microbatch traces and compiles its gradient (as a
        # training step's first step does); the difference of the two runs is the examples' own time
        first = {k: v[:BATCH] for k, v in xs.items()}, ys[:BATCH]
        t0 = time.perf_counter()
        ff.select(model, first, budget=FRACTION, score="fisher", **SELECT, batch_size=BATCH, options={"verbose": 0})
        out["seconds_one_batch"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        plan = ff.select(model, (xs, ys), budget=FRACTION, score="fisher", **SELECT, batch_size=BATCH,
                         options={"verbose": 0})  # fmt: skip
        out["seconds"] = time.perf_counter() - t0
        out["examples"] = a.examples
        out["peak_mb_elements"] = peak_mb()  # the selection's peak (its first batch's run included)
        plan.save(os.path.join(a.workdir, "fisher.json"))
        t0 = time.perf_counter()
        cols = ff.select(model, (xs, ys), budget=FRACTION, score="fisher", **SELECT, structure="columns",
                         batch_size=BATCH, options={"verbose": 0})  # fmt: skip
        out["seconds_columns"] = time.perf_counter() - t0
        cols.save(os.path.join(a.workdir, "fisher-columns.json"))
        out["peak_mb"] = peak_mb()
        return out
    plan = plan_for(a.variant, model, a.size, a.workdir)  # on the float kernels: the same plan after quantize()
    if a.quantize != "none":  # Keras' quantized base (QLoRA: quantize, then LoRA on top)
        if a.variant in ("full", "scattered-table"):
            raise SystemExit(f"{a.variant!r} trains what a quantized base holds as integers: not a variant here")
        backbone.quantize(a.quantize)
    enable_lora(backbone, a.variant)
    frz = None
    if plan is None:
        opt = keras.optimizers.Adam(1e-4)
    else:
        frz = ff.Freezer(model, plan, gradients=a.gradients)
        opt = frz.wrap(keras.optimizers.Adam(1e-4))
    stages["planned"] = peak_mb()
    model.compile(optimizer=opt, loss=loss, jit_compile="auto" if a.jit_compile == "auto" else False)
    out["peak_reset"] = restart_peak()
    stages["before training"] = peak_mb()
    # the trained elements' values only: a copy of every kernel would sit in memory through the steps
    trained = {v.path: ~frz.frozen_mask(v.path) for v in kernels(model)} if frz and a.quantize == "none" else {}
    before = {
        p: np.asarray(keras.ops.convert_to_numpy(v))[trained[p]]
        for p, v in ((v.path, v) for v in kernels(model))
        if frz and p in trained and trained[p].any()
    }
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        model.train_on_batch(x, y)
        times.append(time.perf_counter() - t0)
        if "first step" not in stages:
            stages["first step"] = peak_mb()
            out["steady_reset"] = restart_peak()  # the steps after the first: no tracing or compiling
    out["step_s"] = statistics.median(times[1:]) if len(times) > 1 else times[0]
    out["steady_mb"] = stages["trained"] = peak_mb()
    out["peak_mb"] = max(stages["first step"], out["steady_mb"])
    out["trained"] = int(sum(np.prod(v.shape) for v in model.trainable_weights)) if frz is None else None
    out["optimizer_state"] = int(sum(np.prod(v.shape) for v in opt.variables if len(v.shape)))
    if frz is not None:
        rep = frz.report()
        out["trained"] = rep["totals"]["trainable_elements"]
        frz.verify()
        stages["verified"] = peak_mb()
        moved = all(
            not np.array_equal(before[v.path], np.asarray(keras.ops.convert_to_numpy(v))[trained[v.path]])
            for v in kernels(model) if v.path in before
        )  # fmt: skip
        if a.quantize != "none":  # the kernels are integers, verified bit for bit: their float deltas moved
            deltas = [v for v in model.trainable_weights if v.path.endswith("_trained/values")]
            moved = bool(deltas) and all(np.any(np.asarray(keras.ops.convert_to_numpy(v)) != 0) for v in deltas)
        out["exact"] = bool(moved)
        out["gradients"] = sorted({v.get("gradient", "dense") for v in rep["variables"] if v["state"] == "partial"})
    if a.xla_memory:
        out["xla_temp_mb"] = xla_temp_mb(model, x, y)
    if a.graph_ops:
        out["graph_ops"] = graph_ops()
    return out


def xla_temp_mb(model, x, y) -> float | None:
    """JAX: the temporaries of Keras' training step as XLA compiled it (its state donated), in MB; None elsewhere."""
    import keras

    if keras.backend.backend() != "jax":
        return None
    import jax
    import numpy as np

    groups = (
        model.trainable_variables,
        model.non_trainable_variables,
        model.optimizer.variables,
        model.metrics_variables,
    )
    state = tuple([v.value for v in vs] for vs in groups)
    batch = (keras.tree.map_structure(np.asarray, x), np.asarray(y), None)
    compiled = jax.jit(model.train_step, donate_argnums=0).lower(state, batch).compile()  # compiled, never run
    return compiled.memory_analysis().temp_size_in_bytes / 2**20


def graph_ops() -> int | None:
    """TensorFlow: the operations of every graph alive (the traced step's, its loops' bodies); None elsewhere.

    A graph's operations are memory for as long as the step lives (about 10 kB each).
    """
    import gc

    import keras

    if keras.backend.backend() != "tensorflow":
        return None
    import tensorflow as tf

    return sum(len(g.get_operations()) for g in gc.get_objects() if isinstance(g, tf.Graph))


def peak_mb() -> float:
    """The process's peak resident memory since it started, or since :func:`restart_peak`, in MB (``VmHWM``)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def restart_peak() -> bool:
    """Hand freed memory back to the system and start the peak over from the memory in use now (Linux).

    Building a model and resolving its plan leave freed pages the C allocator
    keeps; they would blur the training peak by a few hundred MB from run to
    run. ``malloc_trim`` returns them; writing 5 to ``/proc/self/clear_refs``
    resets ``VmHWM`` to the resident memory now.
    """
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_child(variant: str, a) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, "--size", a.size, "--dtype", a.dtype, "--steps", str(a.steps)]
    cmd += ["--gradients", a.gradients, "--workdir", a.workdir, "--examples", str(a.examples)]
    cmd += ["--xla-memory"] if a.xla_memory else []
    cmd += ["--graph-ops"] if a.graph_ops else []
    cmd += ["--jit-compile", a.jit_compile, "--quantize", a.quantize] + (["--remat"] if a.remat else [])
    cmd += ["--untied"] if a.untied else []
    got = subprocess.run(cmd, capture_output=True, text=True)
    if got.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{got.stderr[-4000:]}")
    return json.loads(got.stdout.strip().splitlines()[-1])


def memory_table(a) -> None:
    chosen = a.only.split(",") if a.only else VARIANTS
    if any(v in chosen for v in ("fisher", "fisher-columns")) and "select" not in chosen:
        chosen = ["select"] + chosen
    rows = {}
    for v in chosen:
        rows[v] = run_child(v, a)
        print(json.dumps(rows[v]), file=sys.stderr, flush=True)
    floor, full = rows.get("floor", {}).get("peak_mb"), rows.get("full", {}).get("peak_mb")
    steady = {k: rows.get(k, {}).get("steady_mb") for k in ("floor", "full")}
    r0 = next(iter(rows.values()))
    remat = "each decoder block rematerialized, " if a.remat else ""
    remat += "Llama-shaped, untied output table, " if a.untied else ""
    print(f"\n{r0['backend']}, {r0['size']} ({r0['parameters']:,} parameters), {r0['dtype']}, base {a.quantize}, "
          f"{remat}"
          f"batch {BATCH} x {TOKENS} tokens, Adam, {a.steps} steps, gradients={a.gradients!r}\n")  # fmt: skip
    print("| variant | trained elements | optimizer state | peak MB | excess | steady MB | steady excess | plan MB "
          "| step s | exact |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for v, r in rows.items():
        if v == "select":
            continue
        excess = "" if floor is None or full is None else f"{(r['peak_mb'] - floor) / (full - floor):.3f}"
        excess = excess or (f"+{r['peak_mb'] - floor:,.0f} MB" if floor is not None else "")
        calm = (
            ""
            if None in steady.values()
            else f"{(r['steady_mb'] - steady['floor']) / (steady['full'] - steady['floor']):.3f}"
        )
        exact = {True: "yes", False: "frozen only", None: "—"}[r.get("exact")]  # verify() raises otherwise
        plan = r["stages_mb"]["planned"] - r["stages_mb"]["built"]
        lora = rows.get("lora-all", {}).get("peak_mb")
        if floor is not None and lora is not None and lora > floor:  # over LoRA r8 on every projection's extra
            excess += f" ({(r['peak_mb'] - floor) / (lora - floor):.2f} x lora-all's)"
        print(f"| {v} | {r['trained']:,} | {r['optimizer_state']:,} | {r['peak_mb']:,.0f} | {excess} | "
              f"{r['steady_mb']:,.0f} | {calm} | {plan:,.0f} | {r['step_s']:.2f} | {exact} |")  # fmt: skip
    if floor is not None and full is not None and full - floor < 100:
        print(f"\nNote: full fine-tuning peaks {full - floor:.0f} MB above the floor here: the excess columns are "
              "noise at this size (use the default --size).")  # fmt: skip
    counted = {v: r["graph_ops"] for v, r in rows.items() if r.get("graph_ops") is not None}
    if counted:
        print("\nOperations of the traced step's graphs: " + ", ".join(f"{v} {n:,}" for v, n in counted.items()))
    temps = {v: r["xla_temp_mb"] for v, r in rows.items() if r.get("xla_temp_mb") is not None}
    if temps:
        print("\nXLA's temporaries of the compiled step, MB: " + ", ".join(f"{v} {t:,.0f}" for v, t in temps.items()))
    if "select" in rows:
        s = rows["select"]
        per = (s["seconds"] - s["seconds_one_batch"]) / (s["examples"] - BATCH)  # compiling left out, as in step_s
        line = (
            f"\nselect(score='fisher', budget=1 %): {s['examples']} examples in {s['seconds']:.1f} s, "
            f"one batch of {BATCH} in {s['seconds_one_batch']:.1f} s (compiling included): {per:.2f} s per example"
        )
        line += f", columns {s['seconds_columns']:.1f} s; peak {s['peak_mb_elements']:,.0f} MB"
        line += f" (after the columns' selection too: {s['peak_mb']:,.0f} MB)"
        if full is not None:
            line += f" ({s['peak_mb_elements'] / full:.2f} x full fine-tuning's peak, {s['peak_mb'] / full:.2f} with columns"
            line += f"; full's step per example {rows['full']['step_s'] / BATCH:.2f} s)"
        print(line)


def time_table(a) -> None:
    """Step times of every variant in one process, interleaved: rounds of ``steps`` each, medians, spread."""
    import keras
    import numpy as np

    import finefreeze as ff

    chosen = a.only.split(",") if a.only else ["floor", "lora", "rows", "columns", "scattered", "full"]
    x, y = data(a.size)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    models = {}
    for v in chosen:
        model, backbone = build(a.size, a.dtype, a.remat, a.untied)
        plan = plan_for(v, model, a.size, a.workdir)
        if a.quantize != "none":
            backbone.quantize(a.quantize)
        enable_lora(backbone, v)
        opt = (
            keras.optimizers.Adam(1e-4)
            if plan is None
            else ff.Freezer(model, plan, gradients=a.gradients).wrap(keras.optimizers.Adam(1e-4))
        )
        model.compile(optimizer=opt, loss=loss)
        for _ in range(2):  # warm up: traces and compiles
            model.train_on_batch(x, y)
        models[v] = model
    per = {v: [] for v in chosen}
    for _ in range(a.rounds):
        for v in chosen:
            t0 = time.perf_counter()
            for _ in range(a.steps):
                models[v].train_on_batch(x, y)
            per[v].append((time.perf_counter() - t0) / a.steps)
    base = "floor" if "floor" in per else chosen[0]
    print(
        f"\n{keras.backend.backend()}, {a.size}{', untied' if a.untied else ''}, {a.dtype}, base {a.quantize}: step time, {a.rounds} interleaved "
        f"rounds x {a.steps} steps"
    )
    ref = "lora-all" if "lora-all" in per else "lora"  # LoRA on the projections the variants train, where run
    print(f"| variant | median step s | / {base} (min-max of rounds) | / {ref} |")
    print("|---|---|---|---|")
    for v in chosen:
        ratios = [t / b for t, b in zip(per[v], per[base])]
        lora = ""
        if ref in per:
            lr = [t / b for t, b in zip(per[v], per[ref])]
            lora = f"{statistics.median(lr):.2f} ({min(lr):.2f}-{max(lr):.2f})"
        print(f"| {v} | {statistics.median(per[v]):.3f} | {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) | {lora} |")  # fmt: skip
    del np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated variants (default: all)")
    ap.add_argument("--size", default="152m", choices=list(SIZES))
    ap.add_argument("--dtype", default="float32", help="dtype policy: float32, mixed_bfloat16, bfloat16")
    ap.add_argument("--steps", type=int, default=4, help="training steps per variant (per round with --time)")
    ap.add_argument("--gradients", default="auto", help="the Freezer's gradients= (auto, sliced, dense)")
    ap.add_argument("--examples", type=int, default=16, help="examples the fisher selection scores")
    ap.add_argument("--time", action="store_true", help="step times, interleaved in one process")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--quantize", default="none", choices=["none", "int8", "int4"], help="Keras' quantized base (QLoRA's)"
    )
    ap.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "finefreeze-llm-memory"))
    ap.add_argument(
        "--xla-memory", action="store_true", help="JAX: also the compiled step's temporaries (XLA's figure)"
    )
    ap.add_argument(
        "--graph-ops", action="store_true", help="TensorFlow: also the operations of the traced step's graphs"
    )
    ap.add_argument(
        "--jit-compile", default="auto", choices=["auto", "false"], help="Keras' jit_compile (false: no XLA)"
    )
    ap.add_argument("--remat", action="store_true", help="each decoder block rematerialized (keras.RematScope)")
    ap.add_argument("--untied", action="store_true", help="a Llama-shaped LM with its own output table")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.makedirs(a.workdir, exist_ok=True)
    if a.child:
        a.variant = a.child
        print(json.dumps(child(a)))
    elif a.time:
        time_table(a)
    else:
        memory_table(a)


if __name__ == "__main__":
    main()
