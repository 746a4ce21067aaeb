"""What every Freezer shares: a plan resolved against a target, state queries, history, report.

``Freezer`` (Keras models, layers, ``tf.Module``, variable lists) and
``GraphFreezer`` (``tf.compat.v1`` graphs) both derive from
:class:`FreezerBase`; each adds what its kind of target offers and refuses
nothing it inherits. A subclass calls ``super().__init__(plan, strategy)``,
then sets ``self._res`` (and ``self._fingerprint``) from its target.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from finefreeze._backends.distribute import owner_scope
from finefreeze._backends.questions import tensorflow_imported
from finefreeze._errors import PlanError
from finefreeze._keras.optimizers import forget_positions
from finefreeze._kinds import STRATEGIES, State
from finefreeze._optimizer.wrapper import FreezingOptimizer
from finefreeze._plan.plan import Plan
from finefreeze._report.groups import format_groups, wants_detail
from finefreeze._report.plot import plot
from finefreeze._report.report import KERAS_WORDS, build_report, format_summary
from finefreeze._resolve.resolve import Resolution, VarState, closest
from finefreeze._resolve.standins import standin_note
from finefreeze._slices.choose import slice_eligible, standin_of

__all__ = ["FreezerBase", "as_plan", "refuse_graph"]


def as_plan(plan: Plan | list) -> Plan:
    """``plan`` as a :class:`Plan` (a list or tuple of rules is accepted).

    Raises:
        PlanError: anything else.
    """
    if isinstance(plan, (list, tuple)):
        plan = Plan(plan)
    if not isinstance(plan, Plan):
        raise PlanError(f"plan must be an ff.Plan or a list of rules, got {type(plan).__name__}.")
    return plan


def refuse_graph(target: Any) -> None:
    """Refuse a ``tf.compat.v1`` graph target: ``ff.tf1.Freezer`` freezes graph code.

    Raises:
        PlanError: ``target`` is a graph, a graph variable, or a list or
            ``tf.Module`` of them.
    """
    if tensorflow_imported() is None:
        return  # a graph exists only once TensorFlow is imported
    from finefreeze._tf1.target import is_graph_target  # TensorFlow's v1 pieces: graph code only

    if is_graph_target(target):
        raise PlanError(
            f"ff.Freezer takes Keras models, layers, tf.Module objects and variables; this {type(target).__name__} "
            "holds tf.compat.v1 graph variables: use ff.tf1.Freezer(target, plan), which has var_list and "
            "minimize (docs/tf1.md)."
        )


class FreezerBase(abc.ABC):
    """A plan resolved against a target: what is trained, what is frozen, and the report of it.

    Args:
        plan: the :class:`Plan` (a list of rules is accepted too).
        strategy: one of the strategies this kind of Freezer enforces.

    Raises:
        PlanError: not a plan, or an unknown strategy.
    """

    #: the strategies this kind of Freezer enforces
    _strategies: tuple[str, ...] = STRATEGIES
    #: how a report names the state of elements no rule selects, and the untrained variables
    _words: dict = KERAS_WORDS
    #: what the target is called in messages
    _target_word = "target"
    #: how sliced kernels get their weight gradient (``Freezer(..., gradients=)``; graphs: dense)
    _gradients = "dense"

    def __init__(self, plan: Plan | list, strategy: str):
        self._plan_given = as_plan(plan)
        if strategy not in self._strategies:
            raise PlanError(self._strategy_refusal(strategy))
        self._strategy = strategy
        self._history: list[dict] = []
        self._res: Resolution | None = None

    def _strategy_refusal(self, strategy: str) -> str:
        return f"unknown strategy {strategy!r}; choose one of {', '.join(self._strategies)}."

    # -- state ----------------------------------------------------------------
    @property
    def plan(self) -> Plan:
        """The plan in force."""
        return self._res.plan

    @property
    def _slicing(self) -> str:
        """The ``gradients`` mode the layers follow: the Freezer's, or ``"dense"`` under ``restore`` and ``mask``.

        A sliced layer hands its trained elements' gradient to a variable of
        their own, ``compact``'s vector; ``restore`` and ``mask`` hold state
        for the whole variable and take its whole gradient, Keras' own.
        """
        return self._gradients if self._strategy in ("auto", "compact") else "dense"

    @property
    def _held_dense(self) -> list[str]:
        """``gradients="auto"``: paths of kernels on the dense gradient since their slice moved often (``Reselect``)."""
        return sorted(getattr(self, "_held", ()))

    def _gradients_record(self) -> dict:
        """What the optimizer saves of the gradients: ``{"mode", "held_dense", "sliced"}`` (paths the mode slices or samples)."""
        sliced = [
            s.path
            for s in self._res.states
            if s.info.owner is not None and slice_eligible(s.info.owner, s.variable) is not None
        ]
        return {"mode": self._gradients, "held_dense": self._held_dense, "sliced": sliced}

    @property
    def trainable_variables(self) -> list:
        """Variables the optimizer will update at all (trainable or partial), and the stand-ins of sliced kernels.

        A partially frozen kernel whose layer computes the gradient of its
        trained elements only is followed by their stand-in (a flat variable
        of those elements): the step's gradient is the stand-in's, and the
        kernel's is None.

        Comes from this Freezer's plan, never from the Keras flags, so several
        Freezers over one model each keep their own list.
        """
        out = []
        for s in self._res.states:
            if s.state in (State.TRAINABLE, State.PARTIAL):
                out.append(s.variable)
                standin = standin_of(s.info.owner, s.variable) if s.state == State.PARTIAL else None
                if standin is not None:  # a sliced layer hands the trained elements' gradient to it
                    out.append(standin)
        return out

    def _state(self, path) -> VarState:
        if not isinstance(path, str):  # a variable given for its path
            st = self._res.lookup(path)
            if st is not None:
                return st
            name = getattr(path, "path", None)
            if not isinstance(name, str):
                raise PlanError(f"a variable's path (a str) or the variable itself is asked for; got {path!r}.")
            path = name
        st = self._res.by_path(path)
        if st is None:
            paths = [p for s in self._res.states for p in s.info.names]
            note = standin_note(path, [s.variable for s in self._res.states])
            if note:
                raise PlanError(f"no variable of this Freezer's plan has path {path!r}{note}.")
            raise PlanError(
                f"no variable with path {path!r} in this {self._target_word}; "
                f"closest: {', '.join(closest(path, paths))}."
            )
        return st

    def frozen_mask(self, path: str | Any) -> np.ndarray:
        """Bool array of the variable's shape, True where an element is frozen.

        Variables Keras does not train are all True.

        Args:
            path: the variable's path (``"dense/kernel"``), or the variable itself.

        Returns:
            A new bool array.

        Raises:
            PlanError: no variable has that path (a stand-in's path names the kernel it stands for).
        """
        return self._state(path).frozen_mask()

    def variable_state(self, path: str | Any) -> str:
        """``"trainable"``, ``"frozen"``, ``"partial"`` or ``"untrained"``: the state of one variable.

        Args:
            path: the variable's path, or the variable itself.

        Raises:
            PlanError: as :meth:`frozen_mask`.
        """
        return self._state(path).state

    def _optimizers(self) -> list:
        """The live ``FreezingOptimizer`` s that enforce this Freezer's plan (none for a graph Freezer)."""
        return []

    @abc.abstractmethod
    def _strategy_for(self, path: str) -> str | None:
        """The strategy that enforces a partially frozen variable (None for others)."""

    # -- history ----------------------------------------------------------------
    def _follow_standins(self) -> None:
        """Rebuild built optimizers on the stand-ins the layers hand gradients to now (a loaded model's, say).

        An optimizer built before a layer got (or lost) its stand-in holds its
        compact vector itself; the state of every element is carried over.
        """
        var_list = self._build_variables()
        rebuilt = False
        for opt in self._optimizers():
            if opt.built:
                with owner_scope(var_list):
                    opt._commit_change(self._res, opt._prepare_change(self._res, var_list), var_list)
                rebuilt = True
        if rebuilt:
            self._rebuild_outer(var_list)
            self._retrace()

    def _rebuild_outer(self, var_list) -> None:
        """Optimizers wrapped around ours (a LossScaleOptimizer) learn the new variable list.

        Keras' JAX trainer hands them the model's trainable variables and they
        pair them with the list they were built on.
        """
        opt = getattr(self._target.obj, "optimizer", None)
        while opt is not None and not isinstance(opt, FreezingOptimizer) and opt.built:
            forget_positions(opt)
            keras.optimizers.Optimizer.build(opt, list(var_list))
            opt = getattr(opt, "inner_optimizer", None)

    def _record(self, step: int, *, stamp: bool = True, retraced: bool | None = None) -> None:
        entry: dict[str, Any] = {"step": step}
        if stamp:
            entry["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        entry["plan"] = [repr(r) for r in self._res.plan.rules]
        entry["trainable_elements"] = int(sum(s.n_trainable for s in self._res.states))
        if retraced is not None:
            entry["retraced"] = retraced
        self._history.append(entry)

    @property
    def history(self) -> list[dict]:
        """Every plan this Freezer enforced: ``step`` (optimizer iterations), time, rules."""
        return [dict(h) for h in self._history]

    def _fingerprinted(self) -> list[VarState]:
        """The variables whose frozen elements the fingerprint covers."""
        return [s for s in self._res.states if self._res.kind_of(s) in (State.FROZEN, State.PARTIAL)]

    # -- reports -----------------------------------------------------------------
    def report(self) -> dict:
        """JSON-able dict with the per-variable and per-layer facts of :meth:`summary`.

        Each entry of ``report()["variables"]`` names the variable's
        ``state``, its ``strategy`` (partially frozen ones) and its
        ``gradient``: ``"sliced"`` (the weight gradient of its trained slice
        only), ``"sampled"`` (of its scattered trained elements only),
        ``"sparse"`` (TensorFlow embeddings: the batch's rows) or
        ``"dense"``; None for frozen variables. The summary tags such
        variables ``[compact, sliced]`` or ``[compact, sampled]``.

        Returns:
            The report: ``variables``, ``layers``, ``totals`` and the plan's facts.
        """
        return build_report(self, self._words)

    def summary(
        self,
        *,
        variables: bool = True,
        print_fn: Callable[[str], Any] | None = None,
        detail: bool | None = None,
    ) -> str:
        """A table like ``model.summary()``: grouped by block, or per layer and variable.

        Args:
            variables: in the detailed table, list each variable under its layer.
            print_fn: if given, called with the text (``print`` prints it).
            detail: True for the per-layer / per-variable table, False for
                the grouped one (blocks found by ``ff.blocks`` collapsed
                into runs of one state, at most 120 characters wide); None
                (default) picks the detailed table when it fits a screen
                (40 rows) and the grouped one otherwise.

        Returns:
            The table as a string.
        """
        rep = self.report()
        detailed = wants_detail(rep, variables) if detail is None else detail
        text = format_summary(rep, variables=variables, words=self._words) if detailed else format_groups(rep)
        if print_fn is not None:
            print_fn(text)
        return text

    def plot(self, path, *, title: str | None = None) -> str:
        """Draw which variables and elements are frozen to an image file.

        One bar per variable (per layer for large models) split into trained
        (orange) and frozen (blue) elements, and the mask of up to four
        partially frozen variables. Needs matplotlib
        (``pip install 'finefreeze[plot]'``).

        Args:
            path: the image file (``.png``, ``.svg``, ``.pdf``).
            title: replaces the default title (element totals).

        Returns:
            ``path``.

        Raises:
            ImportError: matplotlib is not installed (with the install hint).
        """
        return plot(self, path, title=title)

    def _describe(self) -> str:
        return "Freezer"

    def __repr__(self) -> str:
        r = self.report()["totals"]
        return (
            f"<{self._describe()} {r['trainable_elements']:,} trainable / {r['frozen_elements']:,} frozen "
            f"elements in {r['variables']} variables>"
        )
