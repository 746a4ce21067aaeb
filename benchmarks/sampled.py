"""Scattered trained elements: the weight gradient at those elements only (a sampled product) against the dense one.

A ``Dense`` kernel ``(n_in, n_out)`` of which ``k`` elements ``(i, j)``
train, scattered (no slice holds them): the dense path computes the whole
weight gradient ``x.T @ dy`` (``2 * rows * n_in * n_out`` flops); a sampled
product computes ``sum(x[:, i] * dy[:, j])`` for the ``k`` pairs only
(``2 * rows * k`` flops, gathered), then puts them into the kernel-shaped
gradient. Timed per backend on the compiled function (``tf.function``,
``jax.jit``; PyTorch eager), one thread, interleaved rounds, median
(min-max) of the sampled time over the dense time per trained fraction; the
crossover is the largest fraction at which the sampled product is faster.

    python benchmarks/sampled.py [--rows 192] [--width 896] [--rounds 7]
    KERAS_BACKEND=jax python benchmarks/sampled.py

``--product``: the library's sampled product as the step runs it (the
backend's ``sampled_dots``, in chunks) against the same product written in
``keras.ops`` (``gathered.gathered_dots``), at 1 % of the 152 M LLM's
kernel shapes (512 tokens), side by side in interleaved rounds, and whether
their sums are the same bits (TensorFlow's and JAX's are: the same gathers
and sums; PyTorch's ``sampled_addmm`` sums in its own order).

    python benchmarks/sampled.py --product --rounds 9

``--scattered``: the product with a delta of scattered elements as a
quantized kernel's step runs it (the backend's ``scattered_product``:
``x`` times the matrix that is the delta at 1 % of the 152 M LLM's kernel
shapes, 512 tokens, and the input's gradient from ``dy``) against the same
product in ``keras.ops`` (``functional.scattered_product``, the gathers)
and, on TensorFlow, ``tf.sparse.sparse_dense_matmul`` (on PyTorch, the
gathers summed by ``index_add_``), side by side in
interleaved rounds; the largest difference from the gathers' result.

    python benchmarks/sampled.py --scattered --rounds 9

``--compiled`` (JAX): what XLA compiles per sampled product, which a CPU
holds in memory for as long as the step lives. One program of ``K``
products (1 % of a 1,024 x 1,024-ish kernel each, a width of its own, 512
tokens), compiled in a process of its own for ``K`` = 1 and 32: the
resident memory it leaves, its peak while compiling (``VmHWM`` started over
before), and the optimized program's instructions; per product, the
difference over the 31 more. Then the same 32 products of one shape (the
layers of a model, whose kernels repeat): XLA compiles a kernel once for
every product that has it. The same for Keras' ``Adam`` update of ``K``
deltas of 1 % of a 1,024 x 1,024 kernel's elements each: scattered
elements give each delta a length of its own.

    KERAS_BACKEND=jax python benchmarks/sampled.py --compiled
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cost import threads  # noqa: E402

FRACTIONS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3)


def functions(backend: str, n_in: int, n_out: int):
    """``(compile, dense, sampled)``: the dense weight gradient and the sampled one, kernel-shaped, on ``backend``."""
    from keras import ops

    def dense(x, dy, i, j):
        return ops.matmul(ops.transpose(x), dy)

    def sampled(x, dy, i, j):
        values = ops.sum(ops.take(x, i, axis=1) * ops.take(dy, j, axis=1), axis=0)
        return ops.scatter(ops.stack([i, j], axis=1), values, (n_in, n_out))

    if backend == "tensorflow":
        import tensorflow as tf

        return lambda f: tf.function(f, jit_compile=False), dense, sampled
    if backend == "jax":
        import jax

        return jax.jit, dense, sampled
    return (lambda f: f), dense, sampled


def product(a) -> None:
    """The backend's ``sampled_dots`` against ``gathered.gathered_dots``, at 1 % of the LLM's kernel shapes."""
    import keras
    import numpy as np

    from finefreeze._backends import functional, gathered
    from finefreeze._backends.chosen import chosen
    from finefreeze._slices.sampled import SAMPLED_CHUNK

    backend = keras.backend.backend()
    compile_ = functions(backend, 1, 1)[0]
    rng = np.random.default_rng(0)
    tokens = 512
    print(
        f"## {backend}: the sampled product of 1 % of a kernel, {tokens} tokens, {a.threads or 'default'} thread(s)\n"
    )
    print("| kernel | pairs | backend's, ms | keras.ops, ms | ratio | same bits |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n_in, n_out in ((8192, 1024), (1024, 8192), (1024, 1024)):
        x = keras.ops.convert_to_tensor(rng.normal(size=(tokens, n_in)).astype("float32"))
        dy = keras.ops.convert_to_tensor(rng.normal(size=(tokens, n_out)).astype("float32"))
        flat = np.sort(rng.choice(n_in * n_out, n_in * n_out // 100, replace=False))
        flat = flat[: flat.size // 1024 * 1024]  # padded_index's multiple of 1,024
        index = keras.ops.convert_to_tensor(flat.astype("int32"))

        def columns(part, n_out=n_out):
            return part // n_out, part % n_out

        ours = compile_(lambda x, dy, k: chosen().sampled_dots(x, dy, k, columns, "a", SAMPLED_CHUNK))
        shared = compile_(
            lambda x, dy, k: gathered.gathered_dots(
                x, dy, k, columns, SAMPLED_CHUNK, functional.transposed, functional.map_in_turn
            )
        )
        same = np.array_equal(
            keras.ops.convert_to_numpy(ours(x, dy, index)), keras.ops.convert_to_numpy(shared(x, dy, index))
        )
        times = {ours: [], shared: []}
        for _ in range(a.rounds):
            for f in times:
                t0 = time.perf_counter()
                keras.ops.convert_to_numpy(f(x, dy, index)[:1])
                times[f].append(1000 * (time.perf_counter() - t0))
        t, u = statistics.median(times[ours]), statistics.median(times[shared])
        spread = lambda v: f"{statistics.median(v):.1f} ({min(v):.1f}–{max(v):.1f})"  # noqa: E731
        print(
            f"| {n_in} × {n_out} | {flat.size:,} | {spread(times[ours])} | {spread(times[shared])} | {t / u:.2f} | "
            f"{'yes' if same else 'no'} |"
        )


def _both(f, v, a_, b_, n_in: int, n_out: int):
    """``(x, dy) -> (x times the delta, dy times its transpose)`` by ``f``: the input's gradient reads the pairs in no order."""
    return lambda x, dy: (f(x, v, a_, b_, n_out), f(dy, v, b_, a_, n_in))


def scattered(a) -> None:
    """The backend's ``scattered_product`` against the gathers (and TensorFlow's ``sparse_dense_matmul``)."""
    import keras
    import numpy as np

    from finefreeze._backends import functional
    from finefreeze._backends.chosen import chosen
    from finefreeze._slices.sampled import SAMPLED_CHUNK

    backend = keras.backend.backend()
    compile_ = functions(backend, 1, 1)[0]
    rng = np.random.default_rng(0)
    tokens = 512
    variants = {
        "backend's": lambda t, v, p, q, w: chosen().scattered_product(t, v, p, q, w, SAMPLED_CHUNK),
        "gathers": lambda t, v, p, q, w: functional.scattered_product(t, v, p, q, w, SAMPLED_CHUNK),
    }
    if backend == "tensorflow":
        import tensorflow as tf

        def listed(t, v, p, q, w):
            at = tf.stack([tf.cast(p, tf.int64), tf.cast(q, tf.int64)], axis=1)
            matrix = tf.sparse.reorder(tf.sparse.SparseTensor(at, v, (int(t.shape[1]), w)))
            return tf.transpose(tf.sparse.sparse_dense_matmul(matrix, t, adjoint_a=True, adjoint_b=True))

        variants["tf.sparse.sparse_dense_matmul"] = listed
    if backend == "torch":
        from finefreeze._backends import gathered
        from finefreeze._backends import torch as torch_backend

        def added(t, v, p, q, w):  # the gathers, summed by ``index_add_``
            return gathered.spread(t, v, p, q, w, SAMPLED_CHUNK, torch_backend.transposed, torch_backend.add_rows)

        variants["gathers, index_add_"] = added
    names = list(variants)
    print(f"## {backend}: x times a delta of 1 % scattered elements, and dy times its transpose, {tokens} tokens\n")
    print("| kernel | pairs | " + " | ".join(f"{n}, ms" for n in names) + " | / gathers | largest difference |")
    print("| --- | --- | " + " | ".join("---" for _ in names) + " | --- | --- |")
    for n_in, n_out in ((8192, 1024), (1024, 8192), (1024, 1024)):
        x = keras.ops.convert_to_tensor(rng.normal(size=(tokens, n_in)).astype("float32"))
        dy = keras.ops.convert_to_tensor(rng.normal(size=(tokens, n_out)).astype("float32"))
        flat = np.sort(rng.choice(n_in * n_out, n_in * n_out // 100, replace=False))
        a_, b_ = (keras.ops.convert_to_tensor(c.astype("int32")) for c in (flat // n_out, flat % n_out))
        v = keras.ops.convert_to_tensor(rng.normal(size=flat.size).astype("float32"))
        both = {n: compile_(_both(f, v, a_, b_, n_in, n_out)) for n, f in variants.items()}
        ref = [keras.ops.convert_to_numpy(r) for r in both["gathers"](x, dy)]
        gap = max(
            float(np.abs(keras.ops.convert_to_numpy(r) - w).max()) for n in names for r, w in zip(both[n](x, dy), ref)
        )
        times = {n: [] for n in names}
        for _ in range(a.rounds):
            for n in names:
                t0 = time.perf_counter()
                for r in both[n](x, dy):
                    keras.ops.convert_to_numpy(r[:1])
                times[n].append(1000 * (time.perf_counter() - t0))
        spread = lambda t: f"{statistics.median(t):.1f} ({min(t):.1f}–{max(t):.1f})"  # noqa: E731
        ratio = statistics.median(times[names[0]]) / statistics.median(times["gathers"])
        print(
            f"| {n_in} × {n_out} | {flat.size:,} | "
            + " | ".join(spread(times[n]) for n in names)
            + f" | {ratio:.2f} | {gap:.1e} |"
        )


def compiled(count: int, same: bool = False) -> dict:
    """Compile ``count`` sampled products in one jitted program; the memory it took (MB) and its instructions.

    ``same``: every product of one shape (else a width of its own each).
    """
    import inspect

    import jax
    import numpy as np

    from finefreeze._backends.chosen import chosen
    from finefreeze._slices.sampled import SAMPLED_CHUNK, padded_index

    rng = np.random.default_rng(0)
    tokens, n_in = 512, 1024
    widths = [1024 + (0 if same else k) for k in range(count)]  # a shape each: nothing shared between them
    xs = [jax.numpy.asarray(rng.normal(size=(tokens, n_in)).astype("float32")) for _ in widths]
    dys = [jax.numpy.asarray(rng.normal(size=(tokens, w)).astype("float32")) for w in widths]
    index = [
        jax.numpy.asarray(padded_index(np.flatnonzero(rng.random((n_in, w)) < 0.01)).astype("int32")) for w in widths
    ]

    takes_flat = "flat" in inspect.signature(chosen().sampled_dots).parameters

    def products(xs, dys, index):
        out = []
        for x, dy, k, w in zip(xs, dys, index, widths):
            if takes_flat:
                out.append(chosen().sampled_dots(x, dy, k, lambda part, w=w: (part // w, part % w), "a", SAMPLED_CHUNK))
            else:  # an earlier tree (PYTHONPATH at it), whose product took the pairs' columns
                out.append(chosen().sampled_dots(x, dy, k // w, k % w, "a", SAMPLED_CHUNK))
        return out

    return _compiled_memory(lambda: jax.jit(products).lower(xs, dys, index).compile(), count, same)


def compiled_updates(count: int, same: bool = False) -> dict:
    """Compile Keras' ``Adam`` update of ``count`` deltas in one jitted program; the memory it took (MB).

    Each delta is 1 % of a 1,024 x 1,024 kernel's elements (scattered: a
    count of its own each, unless ``same``), as the optimizer of a plan of
    scattered elements on a quantized base updates them.
    """
    import jax
    import keras
    import numpy as np

    lengths = [10486 + (0 if same else k) for k in range(count)]  # a length each: nothing shared between them
    variables = [keras.Variable(np.zeros(n, "float32"), name=f"delta_{i}") for i, n in enumerate(lengths)]
    opt = keras.optimizers.Adam(1e-3)
    opt.build(variables)
    grads = [jax.numpy.ones(n, "float32") for n in lengths]

    def update(opt_values, grads, values):
        return opt.stateless_apply(opt_values, grads, values)

    args = ([v.value for v in opt.variables], grads, [v.value for v in variables])
    return _compiled_memory(lambda: jax.jit(update).lower(*args).compile(), count, same)


def _compiled_memory(compile_it, count: int, same: bool) -> dict:
    """What ``compile_it()`` left resident and its peak (MB, ``VmRSS`` / ``VmHWM`` over the process's before)."""
    import ctypes
    import gc

    def status(key: str) -> float:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key)) / 1024

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM from here
    program = compile_it()
    peak = status("VmHWM:") - before
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    held = status("VmRSS:") - before
    lines = sum(
        1 for line in program.as_text().splitlines() if line.lstrip().startswith(("%", "ROOT %")) and " = " in line
    )
    return {"products": count, "same": same, "held_mb": held, "peak_mb": peak, "instructions": lines}


def compiled_table() -> None:
    import json
    import subprocess

    for what, title in (
        ("products", "sampled products compiled in one program (1 % of 1,024 x ~1,024 each, 512 tokens)"),
        ("updates", "Adam's updates of deltas compiled in one program (1 % of 1,024 x 1,024 each)"),
    ):
        rows = []
        for count, same in ((1, False), (32, False), (32, True)):
            cmd = [sys.executable, __file__, "--compiled-child", str(count), "--what", what]
            got = subprocess.run(cmd + (["--same-shape"] if same else []), capture_output=True, text=True, check=True)
            rows.append(json.loads(got.stdout.strip().splitlines()[-1]))
        one = rows[0]
        print(f"## jax: {title}\n")
        print(f"| {what} | held MB | peak MB while compiling | instructions |")
        print("| --- | --- | --- | --- |")
        for r in rows:
            shapes = "one shape" if r["same"] else "a shape each"
            print(f"| {r['products']}, {shapes} | {r['held_mb']:.1f} | {r['peak_mb']:.1f} | {r['instructions']:,} |")
        for many in rows[1:]:
            n = many["products"] - one["products"]
            shapes = "one shape" if many["same"] else "a shape each"
            print(
                f"| per {what[:-1]}, {shapes} | {(many['held_mb'] - one['held_mb']) / n:.2f} "
                f"| {(many['peak_mb'] - one['peak_mb']) / n:.2f} "
                f"| {(many['instructions'] - one['instructions']) / n:.0f} |"
            )
        print()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=192, help="rows of x and dy (batch x positions)")
    ap.add_argument("--width", type=int, default=896)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--product", action="store_true", help="the backend's sampled product against keras.ops'")
    ap.add_argument("--scattered", action="store_true", help="the product with a delta of scattered elements")
    ap.add_argument("--compiled", action="store_true", help="JAX: memory and instructions XLA compiles per product")
    ap.add_argument("--compiled-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--same-shape", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--what", default="products", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.compiled_child:
        import json

        measure = compiled if a.what == "products" else compiled_updates
        return print(json.dumps(measure(a.compiled_child, a.same_shape)))
    if a.compiled:
        return compiled_table()
    threads(a.threads)
    if a.product:
        return product(a)
    if a.scattered:
        return scattered(a)

    import keras
    import numpy as np

    backend = keras.backend.backend()
    rng = np.random.default_rng(0)
    n = a.width
    x = keras.ops.convert_to_tensor(rng.normal(size=(a.rows, n)).astype("float32"))
    dy = keras.ops.convert_to_tensor(rng.normal(size=(a.rows, n)).astype("float32"))
    compile_, dense, sampled = functions(backend, n, n)
    dense_c, sampled_c = compile_(dense), compile_(sampled)
    cases = {}
    for frac in FRACTIONS:
        flat = np.sort(rng.choice(n * n, max(1, int(frac * n * n)), replace=False))
        i = keras.ops.convert_to_tensor((flat // n).astype("int32"))
        j = keras.ops.convert_to_tensor((flat % n).astype("int32"))
        ref = keras.ops.convert_to_numpy(dense_c(x, dy, i, j))
        got = keras.ops.convert_to_numpy(sampled_c(x, dy, i, j))
        gap = float(np.abs(got[flat // n, flat % n] - ref[flat // n, flat % n]).max() / np.abs(ref).max())
        cases[frac] = (i, j, gap)

    def timed(f, *args):
        t0 = time.perf_counter()
        for _ in range(a.steps):
            out = f(*args)
        keras.ops.convert_to_numpy(out[:1, :1])  # JAX dispatches asynchronously: wait for the last one
        return (time.perf_counter() - t0) / a.steps

    ratios = {f: [] for f in FRACTIONS}
    dense_ms = []
    for _ in range(a.rounds):
        for frac, (i, j, _) in cases.items():
            d = timed(dense_c, x, dy, i, j)
            s = timed(sampled_c, x, dy, i, j)
            ratios[frac].append(s / d)
            dense_ms.append(1000 * d)
    print(
        f"## {backend}: weight gradient of a Dense({n}) kernel, {a.rows} rows, {a.threads or 'default'} thread(s); "
        f"dense product {statistics.median(dense_ms):.2f} ms\n"
    )
    print("| trained fraction | elements | sampled / dense | rounding (of the largest) |")
    print("| --- | --- | --- | --- |")
    crossover = None
    for frac, r in ratios.items():
        med = statistics.median(r)
        crossover = frac if med < 1 else crossover
        print(
            f"| {100 * frac:g} % | {int(frac * n * n):,} | {med:.2f} ({min(r):.2f}–{max(r):.2f}) | {cases[frac][2]:.1e} |"
        )
    print(f"\nSampled faster up to: {'none of these' if crossover is None else f'{100 * crossover:g} %'}")


if __name__ == "__main__":
    main()
