"""Break the core one line at a time and check that a test catches each break.

Each mutation replaces one piece of source text, runs the tests that should
catch it, and puts the source back (also on Ctrl-C). A mutation that no test
catches is a hole in the test suite; docs/guarantees.md says how many are
caught.

    python benchmarks/mutations.py            # all mutations, about 10 minutes on 2 idle cores
    python benchmarks/mutations.py --only 3   # one of them
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "finefreeze"

# (what breaks, file, original text, replacement, tests that must catch it)
MUTATIONS = [
    (
        "restore: skip the write-back of frozen elements",
        "_enforce/enforcer.py",
        "cur = ops.where(self.mask.value, old, cur)",
        "cur = cur",
        "tests/test_conformance.py -k restore-graph",
    ),
    (
        "restore: gradients of frozen elements not selected to 0",
        "_enforce/enforcer.py",
        "return select_frozen_to_zero(self.mask.value, grad), old",
        "return grad, old",
        "tests/test_conformance.py -k restore-graph",
    ),
    (
        "compact: scatter skipped (trained values never reach the model)",
        "_enforce/enforcer.py",
        "writes.append(scatter_write(self.variable, self.index.value, new))",
        "pass",
        "tests/test_conformance.py -k compact-graph",
    ),
    (
        "migration: drop the EMA reset (released elements' average starts at 0)",
        "_optimizer/migrate.py",
        'if name == "average" or (name == "momentum"',
        'if False and (name == "momentum"',
        "tests/test_seams.py -k ema",
    ),
    (
        "migration: state of elements that keep training is not carried",
        "_optimizer/migrate.py",
        "kept = old_idx[pos] == elements",
        "kept = np.zeros(elements.size, bool)",
        "tests/test_dynamic.py -k transitions_are_exact",
    ),
    (
        "indices: int32 for every variable",
        "_enforce/policy.py",
        'return "int32" if size <= np.iinfo(np.int32).max + 1 else "int64"',
        'return "int32"',
        "tests/test_seams.py -k int32",
    ),
    (
        "unravel: arithmetic in int32 whatever the index dtype",
        "_backends/arrays.py",
        "    dtype = ops.dtype(flat)\n",
        '    dtype = "int32"\n    flat = ops.cast(flat, dtype)\n',
        "tests/test_seams.py -k int32",
    ),
    (
        "auto: compact for every optimizer",
        "_enforce/policy.py",
        "    if opt is None or is_elementwise(opt):",
        "    if True:",
        "tests/test_seams.py -k non_elementwise or schedule_free",
    ),
    (
        "ownership: variables of another model accepted",
        "_enforce/layout.py",
        "        if res.lookup(v) is None and (kernel is None or res.lookup(kernel) is None):",
        "        if False:",
        "tests/test_seams.py -k model_a_refuses",
    ),
    (
        "update: no rollback after a failure",
        "_freezer/freezer.py",
        "                opts[0]._undo_change(u)",
        "                pass",
        "tests/test_seams.py -k fails_midway",
    ),
    (
        "Adafactor: NaN-making plans accepted",
        "_enforce/policy.py",
        "    if hazards:\n        raise PlanError(",
        "    if False:\n        raise PlanError(",
        "tests/test_seams.py -k adafactor",
    ),
    (
        "compact: weight-decay exclusions not mapped to the flat vector",
        "_enforce/enforcer.py",
        "decay_as(o, as_optimizers_see(e.shadow), as_optimizers_see(e.variable))",
        "pass",
        "tests/test_seams.py -k decays_exactly",
    ),
    (
        "report: strategy computed apart from the optimizer's layout",
        "_freezer/freezer.py",
        "            return opts[-1]._layout",
        "            pass",
        "tests/test_seams.py -k wrapped_strategy",
    ),
    (
        "norms: frozen norm from the selected gradient",
        "_optimizer/norms.py",
        "        fn += ops.sum(ops.square(frozen))",
        "        fn += 0.0",
        "tests/test_seams.py -k norms",
    ),
    (
        "wrapper: optimizer settings accepted and ignored",
        "_optimizer/arguments.py",
        "    if kwargs:\n        settings = ",
        "    if False:\n        settings = ",
        "tests/test_seams.py -k refuses_optimizer_settings",
    ),
    (
        "compact: an embedding's sparse gradient densified (its rows' sparse update lost)",
        "_backends/variables.py",
        "    if not is_sparse(grad):\n        return ops.take(flat_dense(grad), idx, axis=0)",
        "    if True:\n        return ops.take(flat_dense(grad), idx, axis=0)",
        "tests/test_seams.py -k sparse_path",
    ),
    (
        "migration: fresh state at zero instead of the optimizer's initial value",
        "_optimizer/migrate.py",
        "init = keras.initializers.get(host_constant(initializer))",
        'init = keras.initializers.get(host_constant("zeros"))',
        "tests/test_seams.py -k initial_accumulator",
    ),
    (
        "Adafactor: a matrix frozen whole counted as a NaN hazard",
        "_enforce/policy.py",
        "if (rows[..., :, None] & cols[..., None, :] & ~whole).any():",
        "if (rows[..., :, None] & cols[..., None, :]).any():",
        "tests/test_seams.py -k frozen_whole",
    ),
    (
        "reload: the Freezer of a loaded model not rebuilt",
        "_freezer/reload.py",
        "        frz = rebuild_freezer(cls, model, opt)",
        "        return None",
        "tests/test_seams.py -k load_model",
    ),
    (
        "step counts: a released element kept on the global count",
        "_optimizer/ages.py",
        "        with counting(o, e.born.value, e.u_product):\n            return plain(gradient, variable, learning_rate)",
        "        return plain(gradient, variable, learning_rate)",
        "tests/test_fresh_state.py",
    ),
    (
        "step counts: released elements' counts not carried through a change",
        "_optimizer/ages.py",
        "    born = np.where(kept, old_born[pos] if n_old else 0, step)",
        "    born = np.full(new.size, step, np.int64)",
        "tests/test_fresh_state.py",
    ),
    (
        "step counts: not restored from a checkpoint",
        "_optimizer/enforcement.py",
        "                self._write_ages(e, (np.asarray(store[str(i)]), None if j is None else np.asarray(store[str(j)])))",
        "                pass",
        "tests/test_fresh_state.py -k checkpoint",
    ),
    (
        "LoRA: a base kernel enable_lora switched off kept outside plans",
        "_resolve/targets.py",
        "            off = not base_trainable(v) and (_lora_base(layer, v) or (lora_root and made_trainable))",
        "            off = False",
        "tests/test_lora.py",
    ),
    (
        "slices: the block keeps only lines trained whole (trained elements outside it)",
        "_slices/choose.py",
        "along = trained.any(axis=tuple(a for a in range(trained.ndim) if a != axis))",
        "along = trained.all(axis=tuple(a for a in range(trained.ndim) if a != axis))",
        "tests/test_slices.py -k masks_that_are_slices or rows",
    ),
    (
        "slices: the block's gradient taken at the wrong place (a range read from the axis' start)",
        "_slices/product.py",
        "                self.places.append((int(idx[0]), int(idx[0]) + len(idx)))",
        "                self.places.append((0, len(idx)))",
        "tests/test_slices.py -k layers_own",
    ),
    (
        "slices: new rows' gradients handed to the stand-in in another order (TensorFlow)",
        "_backends/tensorflow/__init__.py",
        "        places = np.arange(n * width, dtype=np.int32).reshape(n, width)",
        "        places = np.arange(n * width, dtype=np.int32).reshape(n, width)[::-1]",
        "tests/test_slices_rows.py -k dense_path",
    ),
    (
        "slices: an embedding's rows gradient summed into the next row (JAX)",
        "_slices/product.py",
        "            pos = ops.subtract(ids, place[0])",
        "            pos = ops.subtract(ids, place[0] - 1)",
        "KERAS_BACKEND=jax tests/test_slices_rows.py -k dense_path",
    ),
    (
        "auto: a slice that a recurring change moves is not held dense",
        "_slices/calls.py",
        "                    held.add(s.path)\n",
        "",
        "tests/test_slices_auto.py -k changes_often",
    ),
    (
        "auto: the layout follows the gradient computed now, not the mode's slices",
        "_enforce/layout.py",
        "cheap = sparse_gradients(s.info.owner) or slice_eligible(s.info.owner, s.variable) is not None",
        "cheap = sparse_gradients(s.info.owner) or sliced_gradient(s.info.owner, s.variable) is not None",
        "tests/test_slices_auto.py -k resumes_from",
    ),
    (
        "sampled product: each element's row paired with its own row, not its column",
        "_backends/gathered.py",
        "return pair_sums(rows_of(x, xt, a), rows_of(dy, dyt, b))",
        "return pair_sums(rows_of(x, xt, a), rows_of(dy, dyt, a))",
        "tests/test_slices_sampled.py -k plain_keras",
    ),
    (
        "PyTorch's sampled product: a tied table's pairs read as if sorted by the input's column",
        "_backends/torch/__init__.py",
        "rows, cols, left, right = b, a, dy.to(wide).T, x.to(wide)",
        "rows, cols, left, right = a, b, x.to(wide).T, dy.to(wide)",
        "KERAS_BACKEND=torch tests/test_slices_sampled.py -k whatever_order",
    ),
    (
        "sampled product: scattered elements never detected (the dense path)",
        "_slices/choose.py",
        "if n == 0 or n > at_most * frozen.size:",
        "if True:",
        "tests/test_slices_sampled.py -k never_computed",
    ),
    (
        "compact: a table's sparse entries miss each row's last trained element (TensorFlow's row search)",
        "_backends/tensorflow/__init__.py",
        "    count = tf.searchsorted(idx, start + row) - lo\n",
        "    count = tf.searchsorted(idx, start + row) - lo - 1\n",
        "tests/test_embedding_rows.py -k bit_for_bit and adam and dense",
    ),
    (
        "slices: PyTorch's rows gradient drops the batch's first entry in the trained rows",
        "_backends/torch/__init__.py",
        "inside = torch.nonzero(segment < n).squeeze(1)",
        "inside = torch.nonzero(segment < n).squeeze(1)[1:]",
        "KERAS_BACKEND=torch tests/test_slices_rows.py -k dense_path",
    ),
    (
        "JAX: a plan's host values made with jnp.asarray (a program compiled and kept per shape)",
        "_backends/jax/__init__.py",
        "    return jax.device_put(array)",
        "    return jax.numpy.asarray(array)",
        "KERAS_BACKEND=jax tests/test_slices_sampled.py -k compiles_nothing",
    ),
    (
        "JAX: the sampled product's transposed input made from the input alone (held from the forward pass)",
        "_backends/jax/__init__.py",
        "    x = jnp.concatenate([x, _column_after(dy, x)], axis=1)",
        "    x = jnp.asarray(x)",
        "KERAS_BACKEND=jax tests/test_slices_sampled.py -k backward_pass",
    ),
    (
        "TensorFlow: an optimizer built in a traced step makes its variables in the graph (values kept as constants)",
        "_backends/tensorflow/__init__.py",
        "    if not tf.inside_function() or tf.distribute.has_strategy():",
        "    if True:",
        "tests/test_kernel_copies.py -k no_values_in_its_graph",
    ),
    (
        "TensorFlow: variables made eagerly in a traced step, through tf.function's creator (the step traced twice)",
        "_keras/instances.py",
        "        graph._variable_creator_stack = []\n",
        "        graph._variable_creator_stack = creators\n",
        "tests/test_kernel_copies.py -k no_values_in_its_graph",
    ),
    (
        "TensorFlow: the sampled product gathers with keras.ops.take (more operations per scattered kernel)",
        "_backends/tensorflow/__init__.py",
        "functional.transposed, map_in_turn, tf.gather, order, window, _cut",
        "functional.transposed, map_in_turn, None, order, window, _cut",
        "tests/test_kernel_copies.py -k operations_of_a_block",
    ),
    (
        "JAX: the plan's resolution keeps each variable's value (an old buffer kept alive after every write)",
        "_resolve/targets.py",
        "raw=backend_variable(v),",
        'raw=getattr(v, "value", v),',
        "KERAS_BACKEND=jax tests/test_kernel_copies.py -k old_value",
    ),
    (
        "JAX: the sampled product's columns in signed arithmetic (sign corrections compiled per kernel)",
        "_backends/jax/__init__.py",
        "return columns(part.astype(unsigned))",
        "return columns(part)",
        "KERAS_BACKEND=jax tests/test_kernel_copies.py -k compiled_code",
    ),
    (
        "JAX: the sampled product gathers with keras.ops.take (bounds handling compiled per kernel)",
        "_backends/jax/__init__.py",
        "functional.transposed, functional.map_in_turn, gather",
        "functional.transposed, functional.map_in_turn",
        "KERAS_BACKEND=jax tests/test_kernel_copies.py -k compiled_code",
    ),
    (
        "PyTorch: the autograd function's class made in the step (torch.compile splits the step there)",
        "_backends/torch/__init__.py",
        "    from finefreeze._backends.torch.autograd_function import Tap\n",
        "    from finefreeze._backends.torch.autograd_function import Tap as T\n\n    class Tap(T):\n        pass\n",
        "KERAS_BACKEND=torch tests/test_slices.py -k traces_a_sliced_call",
    ),
    (
        "PyTorch: a table's rows' places a NumPy array, converted in the step (torch.compile splits the step there)",
        "_slices/product.py",
        "self._row_of = chosen().index_constant(_row_of(self.shape[0], self.index[0]))",
        "self._row_of = _row_of(self.shape[0], self.index[0])",
        "KERAS_BACKEND=torch tests/test_slices.py -k traces_a_sliced_call",
    ),
    (
        "the backend module imported at every call, as functools.cache's wrapper has torch.compile trace it",
        "_backends/chosen.py",
        "    return _CHOSEN[0]",
        "    return importlib.import_module(_CHOSEN[0].__name__)",
        "KERAS_BACKEND=torch tests/test_slices.py -k traces_a_sliced_call",
    ),
    (
        "a table's scattered elements: each reads the first entry past its row (searchsorted side right)",
        "_backends/functional.py",
        'ops.searchsorted(ids, row, side="left")',
        'ops.searchsorted(ids, row, side="right")',
        "KERAS_BACKEND=jax tests/test_slices_table_elements.py -k plain_keras",
    ),
    (
        "TensorFlow: a table's scattered elements' gradient summed per id, not Keras' entries (Adam's moments differ)",
        "_backends/tensorflow/__init__.py",
        "def table_elements_gradient(elements, ids, dy, flat):",
        "def _entries(elements, ids, dy, flat):",
        "tests/test_slices_table_elements.py -k dense_path",
    ),
    (
        "choose: a table's scattered elements take the table's dense gradient",
        "_slices/choose.py",
        'geometry[0] not in ("dense", "einsum", "rows")',
        'geometry[0] not in ("dense", "einsum")',
        "KERAS_BACKEND=jax tests/test_slices_table_elements.py -k costs_the_batch",
    ),
    (
        "the sampled product transposes the sorted side whole, never a chunk's window of it (the logits' gradient)",
        "_backends/gathered.py",
        "return w if w is not None and 2 * w <= int(side.shape[1]) else None",
        "return None",
        "tests/test_slices_table_elements.py -k transposes_no_more",
    ),
    (
        "a chunk's window: its pairs' columns read from the array's start, not from the window's",
        "_backends/gathered.py",
        "return gather(transpose(cut(t, lo, w)), at - lo)",
        "return gather(transpose(cut(t, lo, w)), at)",
        "tests/test_backend_interface.py -k sampled_dots",
    ),
    (
        "JAX: each turn of the windows' loop reads its pairs' rows as if from the next chunk's window",
        "_backends/jax/__init__.py",
        "_, sums = jax.lax.scan(turn, window_of(los[0]), (parts, los, following))",
        "_, sums = jax.lax.scan(turn, window_of(los[0]), (parts, following, following))",
        "KERAS_BACKEND=jax tests/test_backend_interface.py -k sampled_dots",
    ),
    (
        "FreezeBoard: a watched step takes the dense gradient (a callback changes the path)",
        "_slices/calls.py",
        "return self.sliced and self.holder is not None and self.live()",
        "return self.sliced and self.holder is not None and self.live() and not any("
        "o._track_gradient_norms for o in self.owner()._optimizers())",
        "tests/test_board_backends.py -k same_bits",
    ),
    (
        "TensorFlow: a table's gradient by rows shifted by one row",
        "_backends/tensorflow/__init__.py",
        "start = tf.cast(grad.indices, idx.dtype) * row",
        "start = (tf.cast(grad.indices, idx.dtype) + 1) * row",
        "tests/test_embedding_rows.py -k held_dense",
    ),
    (
        "verify: the first wrap keeps the fingerprint of the weights before a load",
        "_freezer/freezer.py",
        "the baseline\n            self._rebase()",
        "the baseline\n            pass",
        "tests/test_resume.py -k baseline",
    ),
    (
        "a model saved before its first step: the placeholders stay the optimizer's masks",
        "_freezer/reload.py",
        "            self._update(self._res.plan)",
        "            pass",
        "tests/test_resume.py -k first_step",
    ),
    (
        "RematScope: the layer's own call handed to Keras' checkpoint as it is (JAX reuses its first trace)",
        "_slices/calls.py",
        '        set_instance_value(layer, "rematerialized_call", remat_each_call(layer))',
        "        pass",
        "KERAS_BACKEND=jax tests/test_slices_auto.py -k rematerializes",
    ),
    (
        "verify against a reference: an int4 kernel's stored shape read as its logical one",
        "_resolve/fingerprint.py",
        "            stored = tuple(int(d) for d in ref.variable.shape)  # an int4 kernel's: packed, as e.shape is",
        "            stored = tuple(ref.shape)",
        "tests/test_quantized.py -k reference_compares",
    ),
    (
        "ModelParallel: the sampled product cuts a column from a sharded output gradient (XLA replicates it)",
        "_backends/jax/__init__.py",
        "    if keras.distribution.distribution() is None:",
        "    if True:",
        "KERAS_BACKEND=jax tests/test_backends.py -k model_parallel",
    ),
    (
        "TensorFlow: the scattered elements' sparse product kept under XLA, which has no sparse product",
        "_backends/tensorflow/__init__.py",
        "    if in_xla():\n        return functional.scattered_product",
        "    if False:\n        return functional.scattered_product",
        "tests/test_quantized.py -k sparse_product",
    ),
    (
        "TensorFlow: the scattered elements' pairs handed to the sparse row matrix in the order they come",
        "_backends/tensorflow/__init__.py",
        "    pairs = tf.sparse.reorder(tf.sparse.SparseTensor(at, tf.cast(values, wide), shape))",
        "    pairs = tf.sparse.SparseTensor(at, tf.cast(values, wide), shape)",
        "tests/test_backend_interface.py -k scattered_product",
    ),
    (
        "the summary: a frozen quantized kernel left untagged",
        "_report/report.py",
        """v["quantized"] + (" + float delta" if v["state"] != "frozen" else "")""",
        """v["quantized"] + " + float delta" if v["state"] != "frozen" else None""",
        "tests/test_quantized.py -k float_delta_and_every_stored_byte",
    ),
    (
        "a quantized kernel's delta handed to its product as the variable (TensorFlow's eager custom gradient)",
        "_slices/calls.py",
        "        return chosen().current_value(mark.standin)",
        "        return ops.convert_to_tensor(mark.standin)",
        "tests/test_quantized.py -k eager_step",
    ),
    (
        "PyTorch: the scattered elements' pairs handed to the sparse row matrix in the order they come",
        "_backends/torch/__init__.py",
        "    order = torch.argsort(rows * across + cols)",
        "    order = torch.arange(rows.shape[0], device=rows.device)",
        "KERAS_BACKEND=torch tests/test_backend_interface.py -k scattered_product",
    ),
    (
        "PyTorch: the scattered elements' sparse product kept under torch.compile, which traces no sparse tensor",
        "_backends/torch/__init__.py",
        "    if torch.compiler.is_compiling():\n        return gathered.spread",
        "    if False:\n        return gathered.spread",
        "KERAS_BACKEND=torch tests/test_quantized.py -k sparse_product",
    ),
    (
        "TensorFlow: the sampled product's transpose of a layer's input made before its output's gradient exists",
        "_backends/tensorflow/__init__.py",
        "    with tf.control_dependencies([dy]):\n        x = tf.identity(x)\n",
        "",
        "tests/test_slices_sampled.py -k once_its_output",
    ),
    (
        "a quantized untied table's new rows added to the logits as if the table were tied",
        "_slices/quantized.py",
        """    return lookup, (tied_logits if getattr(layer, "tie_weights", False) else None)""",
        """    return lookup, tied_logits""",
        "tests/test_quantized.py -k untied_quantized_tables_rows",
    ),
    (
        "a quantized untied output table's delta left out of the logits",
        "_slices/quantized.py",
        "            return ops.add(logits, ops.cast(_product_delta(ops.matmul, h, ks, taken, standin, index), logits.dtype))",
        "            return logits",
        "tests/test_quantized.py -k untied_quantized_output_tables_new_columns",
    ),
    (
        "a quantized kernel's float delta in the model left unchecked when another delta is applied",
        "_files/entries.py",
        "        if e.quantized is not None:\n            _refuse_other_delta(source, p, vi, e)\n",
        "",
        "tests/test_quantized.py -k another_deltas",
    ),
    (
        "delta export of a quantized run's .keras file: its deltas, which the file does not hold, written as zeros",
        "_cli/deltas.py",
        "    refuse_trained_deltas(frz._res, args.tuned, zeros)\n",
        "",
        "tests/test_cli_quantized.py -k delta_apply_export",
    ),
    (
        "a signal during fit raised where it lands, inside a training step, not at the batch's end",
        "_files/atomic.py",
        "    with _handled_by(_at_checks):\n",
        "    with _handled_by(_on_signal):\n",
        "tests/test_cli_signals.py::test_a_second_signal_stops_at_once"
        " tests/test_cli_signals.py::test_a_signal_inside_a_training_step_stops_fit_when_the_step_is_done",
    ),
    (
        "a resume point that does not record the Keras backend: a run resumed on another one",
        "_cli/checks.py",
        '        "backend": backend_record(),',
        '        "backend_unrecorded": None,',
        "tests/test_cli_signals.py -k own_backend",
    ),
    (
        "float8's scales and amax histories decided by the plan's rules, not by their layer",
        "_resolve/resolve.py",
        "        states = _follow_layers(states)\n",
        "        states = [dataclasses.replace(s, state=FROZEN) if s.info.overwritten else s for s in states]\n",
        "tests/test_float8.py -k statistics",
    ),
    (
        "a scalar variable written to a delta file as a vector of one",
        "_files/delta.py",
        'value = np.asarray(var.numpy(), order="C")',
        "value = np.ascontiguousarray(np.asarray(var.numpy()))",
        "tests/test_float8.py -k delta",
    ),
    (
        "select scores float8's scales and amax histories as weights",
        "_select/select.py",
        "if not vi.base_trainable or vi.overwritten:",
        "if not vi.base_trainable:",
        "tests/test_float8.py -k select",
    ),
    (
        "a rule on a gptq kernel told only that Keras does not train it, not which modes a plan trains",
        "_resolve/resolve.py",
        ") + quantization_note(target, untrained_hits[i])",
        ")",
        "tests/test_quantized.py -k gptq",
    ),
    (
        "SIGTERM while the command line loads kills it with nothing said",
        "_cli/entry.py",
        "    atomic.raise_on_interrupts()  #",
        "    pass  #",
        "tests/test_cli_signals.py -k loads",
    ),
    (
        "a command started ignoring Ctrl-C (`cmd &` in a script) stops at one",
        "_files/atomic.py",
        " if signal.getsignal(s) is not signal.SIG_IGN]",
        "]",
        "tests/test_cli_signals.py -k ignoring",
    ),
]


def run(index: int, mutation) -> tuple[str, float]:
    what, name, old, new, tests = mutation
    path = SRC / name
    source = path.read_text()
    if source.count(old) != 1:
        return f"not applied: the text occurs {source.count(old)} times in {name}", 0.0
    t0 = time.time()
    env = dict(os.environ)
    if tests.startswith("KERAS_BACKEND="):  # a mutation of another backend's path: that backend, without TensorFlow
        backend, tests = tests.split(" ", 1)
        env["KERAS_BACKEND"] = backend.split("=", 1)[1]
        env["FINEFREEZE_TESTS_WITHOUT_TENSORFLOW"] = "1"
    try:
        path.write_text(source.replace(old, new))
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            *tests.split(" -k ")[0].split(),
        ]
        if " -k " in tests:
            cmd += ["-k", tests.split(" -k ", 1)[1]]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    finally:
        path.write_text(source)
    last = [ln for ln in proc.stdout.splitlines() if ln.strip()][-1:] or ["(no output)"]
    verdict = (
        "caught" if proc.returncode == 1 else ("NOT caught" if proc.returncode == 0 else f"error {proc.returncode}")
    )
    return f"{verdict}: {last[0]}", time.time() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", type=int, nargs="*", help="mutation numbers to run (1-based)")
    args = parser.parse_args()
    chosen = args.only or range(1, len(MUTATIONS) + 1)
    print("| # | mutation | file | tests run | result |")
    print("|---|---|---|---|---|")
    missed = 0
    for i in chosen:
        m = MUTATIONS[i - 1]
        result, secs = run(i, m)
        missed += not result.startswith("caught")
        print(f"| {i} | {m[0]} | `{m[1]}` | `{m[4]}` | {result} ({secs:.0f} s) |", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
