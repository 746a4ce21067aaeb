"""The troubleshooting page, built by running each mistake and printing the real message.

Writes docs/troubleshooting.md:  python docs/gen/troubleshooting.py --write
(``tests/test_docs.py`` checks the committed page is what this prints.)
"""

import os
import textwrap
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import finefreeze as ff  # noqa: E402


def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, name="encoder"),
            keras.layers.BatchNormalization(name="norm"),
            keras.layers.Dense(2, name="head"),
        ],
        name="net",
    )


# (title, code run against `m`, how to fix it)
CASES = [
    (
        "A rule selects nothing (a typo)",
        'ff.Freezer(m, ff.Plan([ff.freeze("encodr/**")]))',
        "Fix the selector (the message lists the closest paths). Sequential models prefix "
        "paths with their own name: `**/encoder/**` is the portable form. Use "
        "`ff.Plan(rules, strict=False)` only when a rule may legitimately match nothing.",
    ),
    (
        "An index out of range",
        'ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/kernel[5]")]))',
        "Indices are checked against the variable's shape, never clipped: fix the index.",
    ),
    (
        "A slice beyond a dimension",
        'ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/kernel[:, 0:9]")]))',
        "Slice bounds are checked too (clipping would hide typos): use `[:, 0:8]` or `[:, 0:]`.",
    ),
    (
        "Too many indices",
        'ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/kernel[0, 0, 0]")]))',
        "Give at most one index per dimension; `...` stands for the rest.",
    ),
    (
        "A mask of the wrong shape",
        'ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/kernel", mask=np.ones((3, 3), bool))]))',
        "`mask=` must broadcast to the variable's shape.",
    ),
    (
        "A mask that is not bool",
        'ff.freeze("**/encoder/kernel", mask=np.ones((5, 8)))',
        "Pass a bool array (`mask.astype(bool)`), so 0/1 floats are never misread.",
    ),
    (
        "A where= function that does not return a bool array",
        'ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/kernel", where=lambda w: w * 2)]))',
        "Return a comparison: `where=lambda w: w == 0`.",
    ),
    (
        "A where= function that returns another shape",
        'ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/kernel", where=lambda w: w[0] > 0)]))',
        "A predicate returns one bool per element (`lambda w: np.abs(w) > 0.1`); for a pattern that "
        "repeats along an axis, give it as `mask=`, which broadcasts.",
    ),
    (
        "model.trainable = True after a Freezer",
        "frz = ff.Freezer(m, ff.Plan([ff.freeze('**/encoder/**')]))\n"
        "m.get_layer('encoder').kernel.trainable = True  # what model.trainable = True does on JAX and PyTorch\n"
        "m.compile(optimizer=frz.wrap(keras.optimizers.Adam()), loss='mse')",
        "The plan decides what trains; Keras' flag cannot override it. To train the layer, change the "
        "plan: `frz.update(frz.plan.train('**/encoder/**'))`.",
    ),
    (
        "A delta of another base in a DeltaSwitch",
        "frz = ff.Freezer(m, ff.Plan([ff.freeze('**'), ff.train('**/head/**')]))\n"
        "frz.save_delta('head.safetensors')\n"
        "other = model()\n"
        "other.get_layer('encoder').kernel.assign(np.zeros((5, 8), 'float32'))\n"
        "ff.DeltaSwitch(other, {'head': 'head.safetensors'})",
        "A delta applies to the base it was trained from, bit for bit: load that base (its frozen part "
        "is checked by fingerprint). Nothing in the model was written.",
    ),
    (
        "Bad index syntax",
        'ff.freeze("**/encoder/kernel[0:")',
        "The caret points at the column; indices follow numpy: ints, slices, `...`, lists.",
    ),
    (
        "A bad regular expression",
        'ff.freeze("re:encoder_[0-")',
        "`re:` selectors are Python regular expressions matched against the whole path.",
    ),
    (
        "Index tuples that do not fit",
        'ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/kernel", indices=[(5, 0)])]))',
        "`indices=` takes full index tuples, one per element, within the shape.",
    ),
    (
        "A where= function that raises",
        'ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/kernel", where=lambda w: w[9, 9] > 0)]))',
        "The function gets the variable's numpy value once, at resolution; make it work for every "
        "variable the selector matches (or narrow the selector).",
    ),
    (
        "A selector of an unknown type",
        "ff.freeze(42)",
        "Selectors are strings (globs, `re:`), layer classes or instances, variables or callables.",
    ),
    (
        "A bad glob",
        'ff.freeze("encoder/***")',
        "`*` matches within a path segment, `**` across segments; there is no `***`.",
    ),
    (
        "A layer class the model does not have",
        'ff.Freezer(m, ff.Plan([ff.freeze({"layer_class": "Conv2D"})]))',
        "The class (or its name in plan files) must match a layer of the model; check `model.summary()`.",
    ),
    (
        "Something that is not a rule in a plan",
        'ff.Plan(["**"])',
        'Wrap selectors in rules: `ff.Plan([ff.freeze("**")])`.',
    ),
    (
        "An unknown key in a plan file",
        'ff.Plan.from_dict({"rules": [{"freeze": "**", "mask_": 1}]}, source="plan.yaml")',
        "Rule keys are `freeze` or `train`, and optionally `mask`, `indices`, `rows`, `columns`, `heads`, `lr_scale`.",
    ),
    (
        "A target that is not a model",
        'ff.Freezer("model.keras", ff.Plan([ff.freeze("**")]))',
        "Load the model first (`keras.models.load_model`), or use `finefreeze inspect model.keras` from the shell.",
    ),
    (
        "A plan that leaves nothing to train",
        'ff.Freezer(m, ff.Plan([ff.freeze("**")]))',
        "Add a `train(...)` rule after the freeze (the last rule that selects an element wins).",
    ),
    (
        "A negative lr_scale",
        'ff.train("**/head/**", lr_scale=-1)',
        "Scales are finite and > 0.",
    ),
    (
        "lr_scale=0 instead of freeze",
        'ff.train("**/head/**", lr_scale=0)',
        "A zero step is not freezing: the elements would pay for gradients and optimizer state and escape "
        "`verify()`. `freeze` them.",
    ),
    (
        "An optimizer setting assigned on the wrapper",
        'opt = ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/**")])).wrap(keras.optimizers.Adam())\nopt.use_ema = True',
        "Settings an optimizer acts on when it is built go to the inner optimizer's constructor; "
        "`clipnorm`, `clipvalue`, `global_clipnorm` and `weight_decay` assigned on the wrapper reach the inner "
        "optimizer by themselves.",
    ),
    (
        "An unknown strategy",
        'ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/**")]), strategy="exact")',
        "Use `auto`, `restore`, `compact` or `mask`.",
    ),
    (
        "A plan file with an error",
        'ff.Plan.from_dict({"rules": [{"freeze": "**", "train": "head/**"}]}, source="plan.toml")',
        "One action per rule; the message names the file and rule.",
    ),
    (
        "A frozen element changed behind the optimizer's back",
        'frz = ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/**")]))\n'
        'm.get_layer("encoder").bias.assign(np.ones(8, "float32"))\n'
        "frz.verify()",
        "Something other than the `FreezingOptimizer` wrote a frozen element: another optimizer, "
        "an `assign`, a weight load, or the `mask` strategy with a stateful optimizer. Train with "
        "`frz.wrap(optimizer)`; load weights before creating the Freezer.",
    ),
    (
        "A loss scale optimizer inside the wrapper",
        'frz = ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/**")]))\n'
        "frz.wrap(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()))",
        "Wrap the plain optimizer; under `mixed_float16`, `compile` puts the LossScaleOptimizer outside.",
    ),
    (
        "Optimizer settings given to the wrapper",
        "ff.FreezingOptimizer(keras.optimizers.SGD(0.1), ff.Plan(), clipnorm=1.0)",
        "Give `clipnorm`, `weight_decay`, `use_ema` and the like to the optimizer you wrap, as with "
        "Keras' `LossScaleOptimizer`: `frz.wrap(keras.optimizers.SGD(0.1, clipnorm=1.0))`.",
    ),
    (
        "compact with an optimizer that is not elementwise",
        'frz = ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/kernel[1:]")]), strategy="compact")\n'
        "frz.wrap(keras.optimizers.Lamb())",
        "Use `restore` (or `auto`, which picks `compact` only where it changes nothing but cost). "
        "[Guarantees](guarantees.md) lists the optimizers `compact` serves.",
    ),
    (
        "A plan Keras' Adafactor would turn into NaN",
        'frz = ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/kernel"), ff.train("**/encoder/kernel[0, 0]")]))\n'
        "frz.wrap(keras.optimizers.Adafactor())",
        "Freeze such variables whole, train at least one element in every row or column, or use "
        "Adam, AdamW or Lion for element-level freezing.",
    ),
    (
        "An optimizer wrapped for one model, compiled on another",
        'opt = ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/**")])).wrap(keras.optimizers.Adam())\n'
        'other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2, name="head")], name="other")\n'
        'other.compile(optimizer=opt, loss="mse")\n'
        "other.fit(np.ones((4, 5)), np.ones((4, 2)), verbose=0)",
        "Each model gets an optimizer from its own Freezer: `ff.Freezer(other, plan).wrap(...)`.",
    ),
    (
        "The inexact mask strategy with a stateful optimizer",
        'frz = ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/kernel[0]")]), strategy="mask")\n'
        "frz.wrap(keras.optimizers.AdamW()).build(frz.trainable_variables)",
        "A `FreezeWarning`, not an error: use `restore` or `compact` (or `auto`) for exactness.",
    ),
    (
        "A delta file applied to another base",
        'frz = ff.Freezer(m, ff.Plan([ff.freeze("**/encoder/**")]))\n'
        'frz.save_delta("delta.safetensors")\n'
        'other = model(); other.get_layer("encoder").bias.assign(np.ones(8, "float32"))\n'
        'ff.load_delta(other, "delta.safetensors")',
        "Apply the delta to the model it was trained from; nothing is written when it is refused.",
    ),
    (
        "A Freezer created outside the tf.distribute scope",
        "import tensorflow as tf\n"
        'strategy = tf.distribute.MirroredStrategy(["/cpu:0"])\n'
        "with strategy.scope():\n"
        "    dm = model()\n"
        'ff.Freezer(dm, ff.Plan([ff.freeze("**/encoder/**")]))',
        "Create the Freezer and the optimizer inside `with strategy.scope():`, where the model was built.",
    ),
]


def run(code):
    import tempfile

    ns = {"ff": ff, "keras": keras, "np": np, "model": model, "m": model()}
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
        os.chdir(tmp)  # files the examples write land here
        warnings.simplefilter("always")
        try:
            exec(code, ns)  # noqa: S102 - the page's own examples
        except Exception as e:  # noqa: BLE001 - we print whatever the user would see
            return type(e), str(e)
        finally:
            os.chdir(here)
    for w in caught:
        if issubclass(w.category, ff.FreezeWarning):
            return w.category, str(w.message)
    raise AssertionError(f"no error or warning from:\n{code}")


def page() -> str:
    out = [
        "# Troubleshooting",
        "",
        "Every message below is real: `python docs/gen/troubleshooting.py --write` runs each",
        "mistake and prints what finefreeze says (`tests/test_docs.py` keeps the page true).",
        "Errors are raised before anything changes: flags, values and files stay as they were.",
        "",
        "| exception | kind of failure |",
        "|---|---|",
        "| `ff.PlanError` (a `ValueError`) | a plan, rule, selector or plan file that does not resolve |",
        "| `ff.FrozenValueChanged` (an `AssertionError`) | `verify()` found a frozen element that moved |",
        "| `ff.DeltaError` (a `ValueError`) | a delta file that does not fit its base, or is damaged |",
        "| `ff.DistributionError` (a `RuntimeError`) | a Freezer or optimizer outside its strategy's scope |",
        "| `TypeError` | an optimizer that cannot be wrapped |",
        "| `ff.FreezeWarning` (a `UserWarning`) | works, but probably not what you want |",
        "",
        "The command line prints the first line of the same message and exits with status 2",
        "([cli.md](cli.md)).",
        "",
    ]
    for title, code, fix in CASES:
        kind, message = run(code)
        name = f"ff.{kind.__name__}" if hasattr(ff, kind.__name__) else kind.__name__
        out += [
            f"## {title}",
            "",
            "```python",
            code,
            "```",
            "",
            "```",
            "\n".join(
                wrapped
                for line in f"{name}: {message}".splitlines()
                for wrapped in (textwrap.wrap(line, 100, break_long_words=False, subsequent_indent="    ") or [""])
            ),
            "```",
            "",
            f"**Fix.** {fix}",
            "",
        ]
    return "\n".join(out)


if __name__ == "__main__":
    from _page import page_main

    page_main(__doc__, "troubleshooting.md", page)
