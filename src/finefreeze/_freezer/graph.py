"""Freezers over the variables of a ``tf.compat.v1`` graph, read through a session.

``ff.tf1.Freezer(target, plan)`` takes a ``tf.Graph`` (its
``TRAINABLE_VARIABLES`` collection), a graph variable or a list of them. Plans resolve with the same selectors, indices and rules
as for Keras models; values (for ``where=``, the fingerprint and
``verify()``) are read through a ``tf.compat.v1.Session``, and the train op
comes from :meth:`Freezer.minimize` (``_tf1.train``).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from finefreeze._errors import PlanError
from finefreeze._freezer.base import FreezerBase
from finefreeze._plan.plan import Plan
from finefreeze._resolve.fingerprint import Fingerprint, take
from finefreeze._resolve.resolve import PARTIAL, Resolution, resolve
from finefreeze._resolve.targets import Target
from finefreeze._tf1.target import Fetched, GraphValues, collect_graph
from finefreeze._tf1.train import apply_op, train_op

__all__ = ["Freezer"]

#: a report on a graph: elements no rule selects keep the graph's state
GRAPH_WORDS = {
    "untouched": "graph state",
    "share": "of the trainable variables",
    "untrained": "Not trainable (outside TRAINABLE_VARIABLES)",
}


class Freezer(FreezerBase):
    """A Freezer over ``tf.compat.v1`` graph variables, with an exact train op (``ff.tf1.Freezer``).

    Resolves the plan at once (a bad plan is a ``PlanError`` and nothing
    changes). ``var_list`` is what the optimizer updates at all;
    :meth:`minimize` builds an exact train op. Values are read through a
    session: the one given as ``session=``, else the default session (inside
    ``with tf.compat.v1.Session(graph=g) as sess:``). The fingerprint that
    :meth:`verify` checks is taken at creation when a session with
    initialized variables is at hand, else by :meth:`activate`.

    Args:
        target: a ``tf.Graph`` (the variables of its ``TRAINABLE_VARIABLES``
            collection), a graph variable, a list of them, or a
            ``tf.Module`` built in a graph (its variables).
        plan: the :class:`Plan` (a list of rules is accepted too).
        strategy: ``"auto"`` or ``"restore"`` (the same here: gradient
            selection, update, frozen elements written back).
        session: a ``tf.compat.v1.Session`` of the graph; needed for
            ``where=`` rules, :meth:`activate` and :meth:`verify` when no
            default session is open.

    Raises:
        PlanError: the plan does not resolve, the target is not one graph's
            variables, or a value cannot be read.

    Example:
        >>> import tensorflow as tf, finefreeze as ff
        >>> with tf.Graph().as_default() as g:
        ...     a = tf.compat.v1.get_variable("enc/w", initializer=tf.ones((2, 2)))
        ...     b = tf.compat.v1.get_variable("head/w", initializer=tf.ones((2, 1)))
        ...     frz = ff.tf1.Freezer(g, ff.Plan([ff.freeze("enc/**")]))
        >>> [v.name for v in frz.var_list]
        ['head/w:0']
    """

    _strategies = ("auto", "restore")
    _words = GRAPH_WORDS
    _target_word = "graph"

    def __init__(
        self, target: Any, plan: Plan | list, *, strategy: str = "auto", gradients: str = "auto", session=None
    ):
        super().__init__(plan, strategy)
        if gradients not in ("auto", "dense"):
            raise PlanError(
                f"gradients={gradients!r} is not available for tf.compat.v1 graphs: their train ops take "
                "the dense gradient; give 'auto' or 'dense'."
            )
        plan = self._plan_given
        self._graph, infos = collect_graph(target, lambda v: self._values.read_one(v))  # where= reads
        self._values = GraphValues(self._graph, session)
        target_obj = Target(target, "graph", infos, [])
        self._res: Resolution = resolve(plan, target_obj)
        for s in self._res.states:
            if s.lr_scales is not None or s.lr_scale != 1.0:
                raise PlanError(
                    f"variable {s.path!r}: lr_scale is not available for tf.compat.v1 graphs; build one train "
                    "op per learning rate (a Freezer and an optimizer each) instead."
                )
        self._fingerprint: Fingerprint | None = None
        if self._values.initialized([s.variable for s in self._fingerprinted()]):
            self.activate()  # else activate() later, once the variables have their values
        self._record(0, stamp=False)

    # -- state ------------------------------------------------------------------
    def _strategy_refusal(self, strategy: str) -> str:
        return (
            f"strategy {strategy!r} is not available for tf.compat.v1 graphs; use 'auto' or 'restore' "
            "(gradient selection, update, frozen elements written back: exact with every optimizer)."
        )

    @property
    def graph(self) -> tf.Graph:
        """The graph whose variables this Freezer covers."""
        return self._graph

    @property
    def var_list(self) -> list:
        """The ``var_list`` for ``optimizer.minimize`` / ``compute_gradients``: variables with anything trainable."""
        return self.trainable_variables

    def _strategy_for(self, path: str) -> str | None:
        """``"restore"`` for a partially frozen variable, else None."""
        return "restore" if self._state(path).state == PARTIAL else None

    # -- fingerprint and verify ---------------------------------------------------
    def activate(self, session=None) -> Freezer:
        """Take the fingerprint of every frozen element, through a session.

        Call it once the variables hold the values to keep (after the
        initializer, a checkpoint restore or a warm-up phase) when the
        Freezer was created without a session.

        Args:
            session: a session of the graph; default: the Freezer's, or the
                default session.

        Returns:
            self.

        Raises:
            PlanError: no session, or uninitialized variables.
        """
        states = self._fingerprinted()
        values = self._values.read([s.variable for s in states], session)
        self._fingerprint = take((s.path, Fetched(s.variable, v), s.info.shape, s.mask) for s, v in zip(states, values))
        return self

    def verify(self, reference: Any = None, *, session=None) -> None:
        """Check through a session that every frozen element is bit-identical to the fingerprint.

        Args:
            reference: not available for graphs (None).
            session: a session of the graph; default: the Freezer's, or the
                default session.

        Raises:
            FrozenValueChanged: names each offending variable and the first
                changed block of elements.
            PlanError: no fingerprint yet (see :meth:`activate`), no session,
                or ``reference`` given.
        """
        if reference is not None:
            raise PlanError("verify(reference=...) is not available for graphs; compare values read with sess.run.")
        if self._fingerprint is None:
            raise PlanError(
                "no fingerprint of the frozen elements yet: the Freezer was created without a session. Call "
                "frz.activate(sess) once the variables are initialized, before training."
            )
        entries = self._fingerprint.entries
        now = dict(
            zip((id(e.variable) for e in entries), self._values.read([e.variable.variable for e in entries], session))
        )
        self._fingerprint.verify(read=lambda fetched: [now[id(fetched)]])

    # -- training --------------------------------------------------------------------
    def minimize(self, optimizer, loss, *, global_step=None, name: str | None = None, **kwargs: Any):
        """An exact train op for ``optimizer`` on ``loss``: gradient selection, update, write-back.

        Gradients are computed for :attr:`var_list` only; those of frozen
        elements are selected to zero with ``tf.where`` (sparse
        ``IndexedSlices`` stay sparse); the optimizer's own
        ``apply_gradients`` updates; then, under a control dependency, the
        frozen elements are written back from their value read before the
        update in the same step. Exact with every ``tf.compat.v1.train``
        optimizer (momentum, Adam, Ftrl and proximal ones move zero-gradient
        elements). Several train ops from one graph with different plans need
        an optimizer each (distinct ``name=`` keeps slot names apart).

        Args:
            optimizer: a ``tf.compat.v1.train.Optimizer``.
            loss: a tensor of this Freezer's graph.
            global_step: passed to ``apply_gradients``.
            name: name scope of the ops.
            **kwargs: passed to ``compute_gradients`` (``gate_gradients``,
                ``aggregation_method``, ``colocate_gradients_with_ops``,
                ``grad_loss``).

        Returns:
            The train op (a ``tf.Operation``) to run.

        Raises:
            PlanError: ``loss`` is not a floating tensor of this graph, or
                depends on no variable the plan trains; nothing is added to
                the graph.
            TypeError: ``optimizer`` is not a ``tf.compat.v1.train``
                optimizer (a Keras one goes through :meth:`Freezer.wrap`).

        Example:
            >>> import numpy as np, tensorflow as tf, finefreeze as ff
            >>> with tf.Graph().as_default() as g:
            ...     x = tf.compat.v1.get_variable("x", initializer=tf.ones((2, 2)))
            ...     frz = ff.tf1.Freezer(g, [ff.freeze("x"), ff.train("x", indices=[(0, 0), (1, 1)])])
            ...     op = frz.minimize(tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), tf.reduce_sum(x * x))
            ...     with tf.compat.v1.Session() as sess:
            ...         sess.run(tf.compat.v1.global_variables_initializer())
            ...         _ = frz.activate()
            ...         for _ in range(3):
            ...             _ = sess.run(op)
            ...         frz.verify()
            ...         print(np.round(sess.run(x), 3))
            [[0.062 1.   ]
             [1.    0.062]]
        """
        return train_op(self, optimizer, loss, global_step=global_step, name=name, **kwargs)

    def apply_gradients(self, optimizer, grads_and_vars, *, global_step=None, name: str | None = None):
        """The train op of :meth:`minimize` from gradients you computed (and clipped, say) yourself.

        Pairs of fully frozen variables are left out (never updated); the
        gradients of partially frozen ones are selected, and their frozen
        elements written back after ``optimizer.apply_gradients``, as in
        :meth:`minimize`. A clip before this call sees the frozen elements'
        gradients too; select them first with ``tf.where`` if it must not.

        Args:
            optimizer: a ``tf.compat.v1.train.Optimizer``.
            grads_and_vars: ``(gradient, variable)`` pairs, e.g. from
                ``optimizer.compute_gradients(loss, var_list=frz.var_list)``.
            global_step: passed to ``apply_gradients``.
            name: name scope of the ops.

        Returns:
            The train op (a ``tf.Operation``) to run.

        Raises:
            PlanError: a variable is not one of this Freezer's, or no pair
                has a gradient for a variable the plan trains; nothing is
                added to the graph.
            TypeError: ``optimizer`` is not a ``tf.compat.v1.train``
                optimizer.

        Example:
            >>> import tensorflow as tf, finefreeze as ff
            >>> with tf.Graph().as_default() as g:
            ...     w = tf.compat.v1.get_variable("w", initializer=tf.ones((3,)))
            ...     frz = ff.tf1.Freezer(g, [ff.freeze("w[0]")])
            ...     opt = tf.compat.v1.train.AdamOptimizer(0.1)
            ...     grads = opt.compute_gradients(tf.reduce_sum(w * w), var_list=frz.var_list)
            ...     clipped = [(tf.clip_by_norm(g, 1.0), v) for g, v in grads]
            ...     op = frz.apply_gradients(opt, clipped)
            ...     with tf.compat.v1.Session() as sess:
            ...         sess.run(tf.compat.v1.global_variables_initializer())
            ...         _ = sess.run(op)
            ...         print(sess.run(w).round(3))
            [1.  0.9 0.9]
        """
        return apply_op(self, optimizer, grads_and_vars, global_step=global_step, name=name)

    # -- what graphs do instead ---------------------------------------------------------
    def _describe(self) -> str:
        return "Freezer (tf.compat.v1 graph)"
