"""``FreezeBoard``: what is frozen, and the proof, in TensorBoard."""

from __future__ import annotations

import os
from typing import Any

import keras

from finefreeze._callbacks.lookup import freezer_of
from finefreeze._optimizer.wrapper import find_freezing_optimizer
from finefreeze._report.events import EventWriter, require_tensorboard
from finefreeze._report.maskview import frozen_fraction_image, to_rgb

__all__ = ["FreezeBoard"]


class FreezeBoard(keras.callbacks.Callback):
    """Write the freeze plan and its enforcement to TensorBoard event files.

    At the start of training (and whenever the plan changes) it writes the
    summary table as text (``freeze/summary``), the frozen fraction of each
    variable as scalars (``frozen_fraction/<path>``) and a mask image per
    partially frozen variable (``frozen_mask/<path>``, at most 1024 pixels a side,
    blocks shaded by their frozen fraction: frozen blue, trained
    orange; matrices as they are, other shapes as ``(prod(shape[:-1]),
    shape[-1])`` or a near-square fold of vectors; ``images="all"`` draws
    every variable). Every ``update_freq`` batches it writes the norm of the
    loss gradient on trainable elements (``grad_norm/trainable``) and on
    frozen elements of partially frozen variables (``grad_norm/frozen``: what
    the plan blocked, where the step computes it: a kernel whose trained
    slice or elements get their own gradient computes none for its frozen
    part), at the optimizer's step. The board observes: training gives the
    same bits with it and without it.

    The event files are the ones ``tf.summary`` writes, written by the
    ``tensorboard`` package itself on every Keras backend: FreezeBoard never
    imports TensorFlow.

    Args:
        log_dir: directory of the event files (created if needed).
        freezer: the :class:`Freezer`; defaults to the one whose ``wrap``
            made the model's optimizer.
        update_freq: write gradient norms every this many batches.
        images: ``"partial"`` or ``"all"``.

    Raises:
        ImportError: when the ``tensorboard`` package is not installed
            (``pip install tensorboard``).
        ValueError: for an unknown ``images``, a non-positive ``update_freq``, or a
            ``log_dir`` that is a file.
        TypeError: at the start of ``fit``, when no Freezer is given and the
            model's optimizer is not a ``FreezingOptimizer`` made by
            ``Freezer.wrap``.

    Example:
        >>> import keras, numpy as np, tempfile, finefreeze as ff
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")], name="m")
        >>> frz = ff.Freezer(model, ff.Plan([ff.freeze("**/kernel[0]")]))
        >>> model.compile(optimizer=frz.wrap(keras.optimizers.SGD(0.1)), loss="mse")
        >>> board = ff.callbacks.FreezeBoard(tempfile.mkdtemp())
        >>> _ = model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0, callbacks=[board])
        >>> board.last_gradient_norms[1] > 0  # the loss pushes on kernel[0]; the plan blocks it
        True
    """

    def __init__(
        self, log_dir: str | os.PathLike, freezer: Any = None, *, update_freq: int = 1, images: str = "partial"
    ):
        super().__init__()

        require_tensorboard("FreezeBoard")
        if images not in ("partial", "all"):
            raise ValueError(f"FreezeBoard(images={images!r}): choose 'partial' or 'all'.")
        if int(update_freq) < 1:
            raise ValueError(f"FreezeBoard(update_freq={update_freq!r}): must be a positive number of batches.")
        self.log_dir = os.fspath(log_dir)
        if os.path.exists(self.log_dir) and not os.path.isdir(self.log_dir):
            raise ValueError(f"FreezeBoard(log_dir={self.log_dir!r}): a file is there; give a directory.")
        self.update_freq = int(update_freq)
        self.images = images
        self._freezer = freezer
        self._writer = None
        self._opt = None
        self._batches = 0
        self._written_for = None
        self.last_gradient_norms: tuple[float, float] | None = None

    # -- plumbing --------------------------------------------------------------
    def _sync(self) -> None:
        """Bring the variables up to date: during an epoch Keras' JAX trainer holds their values outside them."""
        sync = getattr(self.model, "jax_state_sync", None) if self.model is not None else None
        if sync is not None:
            sync()

    def _step(self) -> int:
        if self._opt is not None:
            return int(keras.ops.convert_to_numpy(self._opt.iterations))
        return self._batches

    # -- what is written ------------------------------------------------------
    def write_plan(self, step: int | None = None) -> None:
        """Write the summary table, frozen fractions and mask images now.

        Args:
            step: the step of the events; defaults to the optimizer's step.
        """
        self._sync()
        frz = self._freezer_now
        step = self._step() if step is None else step
        rep = frz.report()
        w = self._writer
        w.text("freeze/summary", "```\n" + frz.summary() + "\n```", step)
        for v in rep["variables"]:
            trained_by_keras = v["elements"] if v["state"] != "untrained" else 0
            if trained_by_keras:
                w.scalar(f"frozen_fraction/{v['path']}", v["frozen_elements"] / trained_by_keras, step)
        for s in frz._res.states:
            if s.info.size < 2 or (self.images == "partial" and s.state != "partial"):
                continue
            w.image(f"frozen_mask/{s.path}", to_rgb(frozen_fraction_image(s.frozen_mask(), max_side=1024)), step)
        w.flush()
        self._written_for = frz._res

    def _write_norms(self) -> None:
        if self._opt is None:
            return
        self._sync()
        norms = self._opt._gradient_norms()
        if norms is None:
            return
        self.last_gradient_norms = norms
        step = self._step()
        self._writer.scalar("grad_norm/trainable", norms[0], step)
        self._writer.scalar("grad_norm/frozen", norms[1], step)

    # -- callback hooks ---------------------------------------------------------
    def on_train_begin(self, logs=None):
        self._freezer_now = freezer_of(self.model, self._freezer, "FreezeBoard")
        self._opt = find_freezing_optimizer(self.model)
        self._writer = EventWriter(self.log_dir)
        if self._opt is not None and not self._opt._record_norms(True):
            if getattr(self.model, "train_function", None) is not None:  # the step writes the norms from now on
                self.model.make_train_function(force=True)
        self.write_plan()

    def on_train_batch_end(self, batch, logs=None):
        self._batches += 1
        if self._freezer_now._res is not self._written_for:
            self.write_plan()  # the plan changed (Freezer.update)
        if self._batches % self.update_freq == 0:
            self._write_norms()

    def on_train_end(self, logs=None):
        if self._writer is not None:
            if self._batches % self.update_freq:
                self._write_norms()
            self._writer.close()
            self._writer = None
