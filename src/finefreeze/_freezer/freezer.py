"""``Freezer``: a plan resolved against a model, with its flags and proof."""

from __future__ import annotations

import weakref
from typing import Any

import keras

from finefreeze._backends.arrays import to_numpy
from finefreeze._backends.distribute import check_optimizer, check_scope, owner_scope
from finefreeze._enforce.layout import Layout
from finefreeze._errors import FrozenValueChanged, PlanError
from finefreeze._files.delta import save_delta
from finefreeze._freezer.base import FreezerBase, as_plan, refuse_graph
from finefreeze._freezer.keras_flags import flag_changes, honour_flags, set_flags, warn_switched_off, warn_switched_on
from finefreeze._freezer.reload import Resumable
from finefreeze._optimizer.wrapper import FreezingOptimizer, find_freezing_optimizer
from finefreeze._plan.plan import Plan
from finefreeze._report.state_size import describe
from finefreeze._resolve.fingerprint import fingerprinted_items, take
from finefreeze._resolve.resolve import PARTIAL, resolve
from finefreeze._resolve.targets import collect
from finefreeze._slices.calls import set_sliced
from finefreeze._slices.held import refuse_requantized, retrace

__all__ = ["GRADIENTS", "Freezer"]

#: the values of ``Freezer(..., gradients=)``
GRADIENTS = ("auto", "sliced", "dense")


class Freezer(Resumable, FreezerBase):
    """Resolve a plan against a model, set its Keras flags, and prove it held.

    Creating a Freezer resolves the plan at once; on a bad plan it raises
    ``PlanError`` and the model is left untouched. On success it sets the
    Keras ``trainable`` flags (fully frozen variables: ``trainable=False``; a
    fully frozen BatchNormalization layer: ``layer.trainable=False``) and takes
    a fingerprint of every frozen element.

    Args:
        target: a Keras model or layer, a ``tf.Module``, or a list of
            variables (``tf.compat.v1`` graph code: ``ff.tf1.Freezer``).
        plan: the :class:`Plan` (a list of rules is accepted too).
        strategy: how partially frozen variables are enforced by
            :meth:`wrap`: ``"auto"``, ``"restore"``, ``"compact"``, ``"mask"``.
        gradients: ``"auto"`` (the default): a kernel of a ``Dense``,
            ``EinsumDense`` or ``Conv`` layer whose trained elements form a
            slice (rows, columns, channels, heads), and an ``Embedding``
            whose trained elements lie in some rows, get the weight gradient
            of that slice only where ``benchmarks/`` measured it cheaper, the
            others the whole one; ``"sliced"``: every slice; ``"dense"``:
            every kernel's whole weight gradient, as plain Keras computes it
            (docs/guarantees.md).

    Raises:
        PlanError: the plan does not resolve against ``target``.

    Example:
        >>> import keras, finefreeze as ff
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="a"),
        ...                           keras.layers.Dense(2, name="head")], name="net")
        >>> frz = ff.Freezer(model, ff.Plan([ff.freeze("**"), ff.train("**/head/**")]))
        >>> [v.path for v in frz.trainable_variables]
        ['net/head/kernel', 'net/head/bias']
    """

    def __init__(self, target: Any, plan: Plan | list, *, strategy: str = "auto", gradients: str = "auto"):
        super().__init__(plan, strategy)
        if gradients not in GRADIENTS:
            raise PlanError(
                f"gradients={gradients!r}: give 'auto' (slices get their own gradient where it pays), "
                "'sliced' (always) or 'dense' (never)"
            )
        self._gradients = gradients
        self._held: set[str] = set()  # gradients="auto": kernels kept dense (their slice moves with Reselect)
        refuse_graph(target)
        self._target = collect(target)
        check_scope(
            [vi.variable for vi in self._target.variables], "the Freezer", [vi.path for vi in self._target.variables]
        )
        self._res = resolve(self._plan_given, self._target)
        self._wrapped: list = []  # weak references to optimizers made by wrap()
        self._earlier: list[tuple[str, str]] = []  # violations found at plan changes
        #: how many checkpoints were loaded into the model's optimizer (``load_weights``, ``BackupAndRestore``)
        self._checkpoint_loads = 0
        #: the class and config of the optimizer wrapped last (the summary's state column names it)
        self._last_wrapped = None
        self._activate()
        self._record(0, retraced=False)

    @property
    def _layout(self) -> Layout:
        """The per-variable layout in force.

        The layout of the optimizer compiled into the model, else of the
        optimizer this Freezer wrapped last. Before any ``wrap`` it is the
        layout ``wrap`` would make for an elementwise optimizer (Adam, SGD,
        ...); Lamb, Adafactor, Muon and the like get ``restore`` where this
        shows ``compact``.
        """
        compiled = find_freezing_optimizer(self._target.obj)
        if compiled is not None and compiled._freezer is self and compiled._layout is not None:
            return compiled._layout  # the one that trains the model
        opts = [o for o in self._optimizers() if o._layout is not None]
        if opts:
            return opts[-1]._layout
        return Layout.from_resolution(self._res, self._strategy, None)

    def _strategy_for(self, path: str) -> str | None:
        """The strategy that enforces a partially frozen variable (None for others).

        Read from :attr:`layout`, so it is what the optimizer does.
        """
        st = self._state(path)
        if st.state != PARTIAL:
            return None
        return self._layout.get(st.variable).kind

    # -- flags and fingerprints ----------------------------------------------
    def activate(self) -> Freezer:
        """Make the Keras flags follow this Freezer's plan; refresh the fingerprint.

        Several Freezers may share a model; ``fit`` traces the flags of the one
        created or activated last. A traced train function is rebuilt, and an
        optimizer of this Freezer built while another plan was in force is
        rebuilt on this plan's variables (as :meth:`update` does). Training
        with an optimizer whose plan is not in force warns (``FreezeWarning``).

        A ``layer.trainable`` switched since this Freezer set the flags
        becomes a rule at the end of its plan, with a ``FreezeWarning``.

        Returns:
            self.
        """
        plan = honour_flags(self, self._res.plan)
        if plan is not self._res.plan:
            return self._update(plan)
        warn_switched_on(self._target, self._res)
        return self._activate()

    def _activate(self) -> Freezer:
        set_flags(self._target, self._res)
        sliced = set_sliced(self._target, self._res, self, self._slicing, self._held)
        if any(o.built and o._trains_outside() for o in self._optimizers()):
            return self._update(self._res.plan)  # built under another Freezer's flags: rebuilt on this plan's
        if sliced:
            self._follow_standins()
        self._retrace()
        self._fingerprint = self._take_fingerprint()
        return self

    def _switched(self) -> list[str]:
        """The ``layer.trainable`` switches made since this Freezer set the flags (its optimizer warns of them)."""
        return [what for what, _ in flag_changes(self._target, self._res)]

    def _rebase(self) -> None:
        """Take the frozen baseline from the weights as they are now (a run resumed from a checkpoint)."""
        self._sync()
        self._fingerprint = self._take_fingerprint()

    def _sync(self) -> None:
        """Bring the variables up to date before reading or changing them (callbacks inside ``fit`` call it).

        Keras' JAX trainer keeps the training state outside the variables
        between the steps of an epoch (and purges their values); a callback
        that reads or changes them must sync first.
        """
        sync = getattr(self._target.obj, "jax_state_sync", None)
        if sync is not None:
            sync()

    def _build_variables(self) -> list:
        """What ``fit`` builds the optimizer on: the model's trainable variables (or this Freezer's)."""
        obj = self._target.obj
        return list(obj.trainable_variables) if isinstance(obj, keras.Model) else self.trainable_variables

    def _retrace(self) -> None:
        retrace(self._target.obj)

    def _optimizers(self) -> list[FreezingOptimizer]:
        """The live ``FreezingOptimizer`` s of this Freezer: those it wrapped, and one compiled into a loaded model.

        Reports and ``update`` read them; ``Freezer.of`` binds a loaded model's optimizer.
        """
        opts = [o for o in (r() for r in self._wrapped) if o is not None]
        compiled = find_freezing_optimizer(self._target.obj)
        if compiled is not None and compiled._freezer is None and compiled not in opts:  # a loaded model's
            opts.append(compiled)
        return opts

    def update(self, plan: Plan | list, *, often: bool = False) -> Freezer:
        """Change what is frozen, between steps (also from a callback inside ``fit``).

        A transaction: the new plan is resolved and checked against every
        optimizer first; a plan that is refused raises and changes nothing
        (flags, layout, optimizer state, fingerprints), and a failure while
        the change is put in force is rolled back. Element-mask and
        ``lr_scale`` changes of variables that stay partially frozen take
        effect without retracing, unless the trained slice of a sliced kernel
        moves (the slice is part of the step). Variable-level changes set the Keras flags,
        rebuild the optimizers' per-variable state around the same inner
        optimizer and retrace the train function. Elements that keep training
        keep their state; released ones get a fresh optimizer's (zero moments,
        an EMA average equal to their value, a step count from now on).
        ``verify()`` keeps checking what was frozen before the change, up to
        the change, and checks newly frozen elements from now on. A
        ``layer.trainable`` switched since the flags were set becomes a rule
        at the end of ``plan``, with a ``FreezeWarning``. ``fit``
        picks up the retraced function itself; a custom loop wraps its step
        in a new ``tf.function`` when ``history[-1]["retraced"]`` is True.

        Args:
            plan: the new :class:`Plan` (or list of rules).
            often: the plan will change again soon (``Reselect`` says so):
                with ``gradients="auto"``, a sliced kernel whose slice this
                change moves gets the dense gradient from now on, so that
                the next changes need no retrace.

        Returns:
            self.

        Raises:
            PlanError: the plan does not resolve; nothing changed.

        Example:
            >>> import keras, numpy as np, finefreeze as ff
            >>> m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, name="a"),
            ...                       keras.layers.Dense(2, name="b")], name="m")
            >>> frz = ff.Freezer(m, ff.Plan([ff.freeze("**/a/**")]))
            >>> m.compile(optimizer=frz.wrap(keras.optimizers.Adam()), loss="mse")
            >>> _ = m.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
            >>> _ = frz.update(ff.Plan([ff.freeze("**/b/**")]))
            >>> _ = m.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
            >>> [v.path for v in frz.trainable_variables]
            ['m/a/kernel', 'm/a/bias']
            >>> [h["step"] for h in frz.history]
            [0, 1]
        """
        if not isinstance(often, bool):
            raise PlanError(f"update(..., often={often!r}): give True (the plan changes again soon) or False")
        given = as_plan(plan)
        plan = honour_flags(self, given)
        if plan is given:
            warn_switched_on(self._target, self._res)
        return self._update(plan, often)

    def _update(self, plan: Plan, often: bool = False) -> Freezer:
        self._sync()
        res = resolve(plan, self._target)
        opts = self._optimizers()
        old, held = self._res, set(self._held)
        # Everything that can refuse the plan runs before anything changes.
        self._res = res
        try:
            flags_changed = set_flags(self._target, self._res)
            flags_changed |= set_sliced(self._target, self._res, self, self._slicing, self._held, often)
            var_list = self._build_variables()
            layouts = [opt._prepare_change(res, var_list) for opt in opts]
        except Exception:
            self._res, self._held = old, held
            set_flags(self._target, self._res)
            set_sliced(self._target, self._res, self, self._slicing, self._held)
            raise
        step = self._step
        earlier = [(p, f"{w} (before the plan change at step {step})") for p, w in self._fingerprint.check()]
        undo = [opt._begin_change() for opt in opts]
        retrace = True
        try:
            retrace = flags_changed
            with owner_scope(var_list):  # new optimizer variables must be mirrored like the model's
                for opt, layout in zip(opts, layouts):
                    retrace |= opt._commit_change(res, layout, var_list)
        except BaseException:
            for u in undo:
                opts[0]._undo_change(u)
            self._res, self._held = old, held
            set_flags(self._target, self._res)
            set_sliced(self._target, self._res, self, self._slicing, self._held)
            self._retrace()
            raise
        self._earlier += earlier
        if retrace:
            self._rebuild_outer(var_list)
            self._retrace()
        self._fingerprint = self._take_fingerprint()
        self._record(step, retraced=retrace)
        return self

    @property
    def _step(self) -> int:
        """The optimizer step of this Freezer's first optimizer (0 without one); ``FreezeSchedule`` reads it."""
        self._sync()
        opts = self._optimizers()
        return int(to_numpy(opts[0].iterations)) if opts else 0

    def _take_fingerprint(self):
        return take(fingerprinted_items(self._fingerprinted()))

    def verify(self, reference: Any = None) -> None:
        """Check that every frozen element is bit-identical to freeze time.

        Args:
            reference: optional; compare the frozen elements with the same
                variables of this model (say, the base a fine-tune started
                from) instead of the fingerprint, naming every changed
                element.

        Raises:
            FrozenValueChanged: names each offending variable and the first
                changed elements (to a block of 256 elements against the
                fingerprint, to the element against a reference).
            PlanError: ``reference`` lacks a variable or has another shape.

        Example:
            >>> import keras, numpy as np, finefreeze as ff
            >>> w = keras.Variable(np.zeros((2, 2), "float32"), name="w")
            >>> frz = ff.Freezer([w], ff.Plan([ff.freeze("w[0]")]))
            >>> _ = w.assign([[0.0, 1.0], [5.0, 5.0]])
            >>> frz.verify(reference=[keras.Variable(np.zeros((2, 2), "float32"), name="w")])
            Traceback (most recent call last):
            ...
            finefreeze._errors.FrozenValueChanged: 1 variable(s) have frozen elements that changed from the reference:
              w: 1 frozen element(s) differ at (0, 1) (shape (2, 2))
            ...
        """
        self._sync()
        if reference is None:
            if self._earlier:
                bad = self._earlier + self._fingerprint.check()
                lines = "\n".join(f"  {p}: {w}" for p, w in bad)
                raise FrozenValueChanged(f"{len(bad)} frozen part(s) changed:\n{lines}", bad)
            self._fingerprint.verify()
        else:
            self._fingerprint.verify(reference=collect(reference))

    # -- optimizer -------------------------------------------------------------
    def wrap(
        self, optimizer: keras.optimizers.Optimizer, *, strategy: str | None = None, step_count: str = "release"
    ) -> FreezingOptimizer:
        """Return a :class:`FreezingOptimizer` around ``optimizer`` for this plan.

        Args:
            optimizer: a Keras optimizer (not a ``LossScaleOptimizer``).
            strategy: overrides the Freezer's strategy.
            step_count: ``"release"`` (a released element counts steps from its release) or ``"global"``.

        The first ``wrap`` takes the fingerprint that :meth:`verify` checks
        anew: the weights the model is compiled with (a checkpoint loaded
        after the Freezer was made, say) are the frozen baseline.

        Returns:
            The wrapping ``FreezingOptimizer``.
        """
        plan = honour_flags(self, self._res.plan)  # layer.trainable switched since the flags were set
        if plan is not self._res.plan:
            self._update(plan)
        warn_switched_on(self._target, self._res)
        warn_switched_off(self._res)
        refuse_requantized(self._res)
        variables = [vi.variable for vi in self._target.variables]
        check_scope(variables, "the FreezingOptimizer")
        check_optimizer(optimizer, variables, "Freezer.wrap")
        strategy = strategy or self._strategy
        if strategy not in self._strategies:
            raise PlanError(self._strategy_refusal(strategy))
        layout = Layout.from_resolution(self._res, strategy, optimizer)
        opt = FreezingOptimizer(optimizer, self._res.plan, strategy=strategy, step_count=step_count)
        opt._start_from(resolution=self._res, layout=layout)
        opt._refuse_nan(layout)
        opt._bind_freezer(self, strong=True)  # the optimizer keeps its Freezer (and its stand-ins) alive
        self._wrapped.append(weakref.ref(opt))
        if len(self._wrapped) == 1 and not self._earlier:
            # the first optimizer starts training: weights loaded since the Freezer was made are the baseline
            self._rebase()
        self._last_wrapped = describe(optimizer)  # the summary names it, even once the wrapper is dropped
        return opt

    # -- delta files -------------------------------------------------------------
    def save_delta(self, path) -> dict:
        """Write only what training may have changed to a safetensors file.

        Trainable variables in full, partially frozen ones as flat indices
        and values of their trainable elements, with metadata: the plan, a
        fingerprint of the frozen part, shapes, dtypes, library version. The
        write is atomic.

        Args:
            path: the ``.safetensors`` file to write.

        Returns:
            ``{"path", "bytes", "tensors"}``.
        """
        return save_delta(self, path)
