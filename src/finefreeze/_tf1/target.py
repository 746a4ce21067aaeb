"""The variables of a ``tf.compat.v1`` graph as a target, and their values through a session."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from finefreeze._errors import PlanError
from finefreeze._resolve.targets import VarInfo, var_path

__all__ = ["GraphValues", "collect_graph", "Fetched", "is_graph_target"]

_INIT_HINT = "run `sess.run(tf.compat.v1.global_variables_initializer())` (or restore a checkpoint) first"


def _graph_of(v) -> tf.Graph | None:
    """The graph of a ``tf.compat.v1`` graph variable; None for eager (and non-) variables."""
    if not isinstance(v, tf.Variable):
        return None
    try:
        g = v.graph
    except AttributeError:  # eager variables have no graph
        return None
    return None if g is None or getattr(g, "building_function", False) else g


def is_graph_target(target: Any) -> bool:
    """Whether ``target`` is a ``tf.Graph``, a graph variable, or a non-empty list (or ``tf.Module``) of them."""
    if isinstance(target, tf.Graph):
        return True
    if isinstance(target, tf.Module):
        target = list(target.variables)
    if isinstance(target, (list, tuple)):
        return bool(target) and any(_graph_of(v) is not None for v in target)
    return _graph_of(target) is not None


@dataclasses.dataclass(eq=False)
class _GraphVarInfo(VarInfo):
    read: Callable[[Any], np.ndarray] | None = None  # value through a session

    def numpy(self):
        return self.read(self.raw)


class Fetched:
    """A variable's value read through a session, in the shape a fingerprint reads it."""

    def __init__(self, variable, value):
        self.variable, self.value = variable, value

    def numpy(self):
        return self.value


def collect_graph(target: Any, read) -> tuple[tf.Graph, list[_GraphVarInfo]]:
    if isinstance(target, tf.Graph):
        graph, items = target, target.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
        if not items:
            raise PlanError(
                "the graph has no variables in its TRAINABLE_VARIABLES collection; create the model's "
                "variables in this graph (under `with graph.as_default():`) before the Freezer."
            )
    else:
        if isinstance(target, tf.Module):  # a module built in a graph: its variables
            target = list(target.variables)
        items = list(target) if isinstance(target, (list, tuple)) else [target]
        graphs = {}
        for i, v in enumerate(items):
            g = _graph_of(v)
            if g is None:
                what = f"a {type(v).__name__}" if not isinstance(v, tf.Variable) else "an eager variable"
                raise PlanError(
                    f"target item {i} ({var_path(v) if isinstance(v, tf.Variable) else v!r}) is {what}, not a "
                    "tf.compat.v1 graph variable; give variables of one graph (or the tf.Graph itself)."
                )
            graphs.setdefault(id(g), (g, var_path(v)))
        if len(graphs) > 1:
            names = ", ".join(p for _, p in graphs.values())
            raise PlanError(
                f"the target's variables belong to {len(graphs)} different graphs (e.g. {names}); a Freezer "
                "covers the variables of one graph."
            )
        graph = next(iter(graphs.values()))[0]
    trainable = {id(v) for v in graph.get_collection(tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)}
    infos, seen = [], set()
    for v in items:
        if id(v) in seen:
            continue
        seen.add(id(v))
        p = var_path(v)
        shape, dtype = tuple(int(d) for d in v.shape), v.dtype.base_dtype.name
        infos.append(_GraphVarInfo(p, (p,), v, v, shape, dtype, None, id(v) in trainable, False, read=read))
    return graph, infos


def _readable(sess, v) -> bool:
    try:
        sess.run(v)  # the variable's own read op: nothing is added to the graph
    except tf.errors.FailedPreconditionError:
        return False
    return True


class GraphValues:
    """Reads a graph's variables through a session: the one given, the default one, or none (a PlanError)."""

    def __init__(self, graph: tf.Graph, session=None):
        self.graph, self.session = graph, None
        self.session = self.pick(session)  # checks that it runs this graph

    def pick(self, session=None):
        """The session to read with: ``session``, else the one given at creation, else the default one."""
        if session is not None:
            if session.graph is not self.graph:
                raise PlanError(
                    "the session runs another graph than the Freezer's variables; give the session made "
                    "with `tf.compat.v1.Session(graph=g)` for their graph."
                )
            return session
        if self.session is not None:
            return self.session
        default = tf.compat.v1.get_default_session()
        return default if default is not None and default.graph is self.graph else None

    def read(self, variables: list, session=None) -> list[np.ndarray]:
        """The values of ``variables`` in one ``sess.run``.

        Raises:
            PlanError: no session, a closed one, or uninitialized variables.
        """
        sess = self.pick(session)
        if sess is None:
            raise PlanError(
                "reading the graph's variables needs a session: pass session=sess, or call this inside "
                "`with tf.compat.v1.Session(graph=g) as sess:`."
            )
        try:
            return [np.asarray(x) for x in sess.run(list(variables))]
        except tf.errors.FailedPreconditionError:
            missing = [var_path(v) for v in variables if not _readable(sess, v)]
            raise PlanError(f"variables not initialized in this session: {', '.join(missing)}; {_INIT_HINT}.") from None
        except RuntimeError as e:  # a closed session
            raise PlanError(f"cannot read the graph's variables: {e}; use an open session of the graph.") from None

    def initialized(self, variables: list) -> bool:
        """Whether a session is at hand and every one of ``variables`` has a value in it."""
        sess = self.pick()
        return sess is not None and all(_readable(sess, v) for v in variables)

    def read_one(self, variable) -> np.ndarray:
        return self.read([variable])[0]
