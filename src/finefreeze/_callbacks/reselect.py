"""``Reselect``: drop the elements that moved least, regrow as many by gradient (SpIEL)."""

from __future__ import annotations

import warnings
from typing import Any

import keras
import numpy as np

from finefreeze._backends.arrays import to_numpy
from finefreeze._backends.gradients import need_gradients
from finefreeze._callbacks.lookup import freezer_of
from finefreeze._errors import FreezeWarning, PlanError
from finefreeze._plan.plan import Plan
from finefreeze._plan.rules import freeze, train
from finefreeze._select.scores import stream_scores
from finefreeze._select.select import rule_selector, top_k

__all__ = ["Reselect"]


class Reselect(keras.callbacks.Callback):
    """At every multiple of ``every`` optimizer steps, swap part of the trained elements for better ones (SpIEL-style).

    In each partially frozen variable (say, from :func:`finefreeze.select`),
    the ``fraction`` of trained elements that moved least since training
    began (|θ − θ₀|) are frozen where they are, and as many frozen elements
    of the same variable with the largest gradient, summed in absolute value
    over ``batches`` batches of ``data``, start training. Each variable keeps
    its number of trained elements, so the change is an element-mask change
    through ``Freezer.update`` (no retrace under ``restore`` or ``compact``): kept elements
    keep their optimizer state, regrown ones start from fresh state, frozen
    ones stay bit-identical. Variables trained in full or frozen in full are
    left alone. Ties go to the lower flat index. Runs inside ``fit`` on the
    TensorFlow, JAX and PyTorch backends.

    Args:
        data: where the regrowth gradient comes from: ``(x, y)`` arrays, a
            ``tf.data.Dataset`` or an iterable of ``(x, y)`` batches (as in
            :func:`finefreeze.select`); it is read afresh at each reselection,
            so pass something that can be iterated again (not a generator).
        every: optimizer steps between reselections.
        fraction: share of each variable's trained elements swapped (0, 1].
        batches: batches of ``data`` summed for the regrowth gradient.
        loss: the loss; default the model's compiled loss.
        batch_size: batch size when ``data`` is arrays.
        freezer: the :class:`Freezer`; defaults to the one whose ``wrap`` made
            the model's optimizer.

    Raises:
        PlanError: bad ``every``, ``fraction`` or ``batches`` (at construction);
            no partially frozen variable, or a backend other than TensorFlow,
            JAX and PyTorch, when training starts.

    Example:
        >>> import keras, numpy as np, finefreeze as ff
        >>> m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="a")], name="m")
        >>> frz = ff.Freezer(m, ff.select(m, budget=0.375, score="random"))  # 6 of 16
        >>> m.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.1)), loss="mse")
        >>> x, y = np.ones((8, 3), "float32"), np.zeros((8, 4), "float32")
        >>> cb = ff.callbacks.Reselect((x, y), every=2, fraction=0.5)
        >>> _ = m.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[cb])
        >>> [h["step"] for h in frz.history], frz.history[-1]["trainable_elements"]
        ([0, 2, 4], 6)
    """

    def __init__(
        self,
        data: Any,
        *,
        every: int,
        fraction: float = 0.1,
        batches: int = 1,
        loss: Any = None,
        batch_size: int = 32,
        freezer: Any = None,
    ):
        super().__init__()
        for name, v in (("every", every), ("batches", batches), ("batch_size", batch_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"Reselect: {name} must be an int >= 1; got {v!r}.")
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise PlanError(f"Reselect: fraction must be in (0, 1]; got {fraction!r}.")
        self.data, self.every, self.fraction, self.batches = data, every, float(fraction), batches
        self.loss, self.batch_size, self._given = loss, batch_size, freezer
        self.swaps: list[dict] = []  #: per reselection: step and elements swapped per variable
        self._resumable_warned = False

    def on_train_begin(self, logs=None):
        need_gradients("gradient")
        self.freezer = freezer_of(self.model, self._given, "Reselect")
        frz = self.freezer
        frz._sync()  # JAX: the values of an epoch in progress
        self._base = frz.plan
        self._vars = [v for v in frz.trainable_variables if frz.variable_state(v.path) == "partial"]
        if not self._vars:
            raise PlanError(
                "Reselect: the plan has no partially frozen variable to reselect in; "
                "start from a plan of element masks, e.g. ff.select(model, data, budget=0.01)."
            )
        if frz._checkpoint_loads and not self._resumable_warned:
            self._resumable_warned = True
            warnings.warn(
                "Reselect started after a checkpoint was loaded into the model (BackupAndRestore listed "
                "before it, or load_weights): it measures how far elements moved from the restored "
                "weights, not from where training began, so this run will not reselect as an "
                "uninterrupted one. List Reselect before BackupAndRestore in callbacks=[...].",
                FreezeWarning,
                stacklevel=2,
            )
        self._theta0 = [np.array(to_numpy(v), copy=True) for v in self._vars]
        self._cache: dict = {}  # the gradient accumulators and traced step, reused at every reselection
        self._next = None  # the next multiple of `every`, read at the first batch (after a restore)

    def _iterations(self) -> int:
        self.freezer._sync()  # JAX: fit keeps the state outside the variables during an epoch
        return int(to_numpy(self.model.optimizer.iterations))

    def on_train_batch_end(self, batch, logs=None):
        now = self._iterations()
        if self._next is None:
            self._next = (max(now - 1, 0) // self.every + 1) * self.every
        if now >= self._next:
            self.reselect()
            self._next = (self._iterations() // self.every + 1) * self.every

    def reselect(self) -> Plan:
        """Swap elements now; return the plan put in force."""
        if getattr(self, "freezer", None) is None:  # called outside fit: set up as at train begin
            self.on_train_begin()
        frz = self.freezer
        frz._sync()
        grads = stream_scores(
            self.model,
            self._vars,
            self.data,
            score="gradient",
            loss=self.loss,
            batch_size=self.batch_size,
            limit=self.batches,
            microbatch=1,
            epochs=1,
            optimizer=None,
            verbose=0,
            cache=self._cache,
        )
        rules, swapped = list(self._base.rules), {}
        for v, theta0, g in zip(self._vars, self._theta0, grads):
            frozen = frz.frozen_mask(v.path)
            trained = ~frozen
            d = min(int(np.floor(self.fraction * np.count_nonzero(trained) + 0.5)), int(np.count_nonzero(frozen)))
            if d > 0:
                moved = np.abs(np.asarray(to_numpy(v), np.float32) - theta0.astype(np.float32))
                drop = top_k([np.negative(moved)], [trained], d)[0]
                grow = top_k([g], [frozen], d)[0]
                trained = (trained & ~drop) | grow
                swapped[v.path] = d
            sel = rule_selector(v.path)
            rules += [freeze(sel), train(sel, mask=trained)]
        plan = Plan(rules, strict=self._base.strict, batchnorm=self._base.batchnorm)
        frz.update(plan, often=True)  # again in a few steps: gradients="auto" keeps moved slices dense
        self.swaps.append({"step": self._iterations(), "swapped": swapped})
        return plan
