"""The house keeps its shape: rooms in layers, no import cycles, no reach-ins, no stray local imports.

Reads every module of ``src/finefreeze`` as text (nothing is imported).
The layering, lowest first, is :data:`LAYERS`: a module may import its own
room and the rooms below it. Function-local imports of finefreeze's own
modules are for backends and optional pieces only (:data:`LOCAL_IMPORTS`);
a cross-room use of another room's private name (``frz._x``, ``from
finefreeze._a.b import _c``) is part of the private protocol that
docs/architecture.md lists, and no object writes another's private
attributes (ownership).
"""

import ast
import pathlib
import re

import pytest

pytestmark = pytest.mark.backends("tensorflow", reason="the source's imports, the same on every backend")

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "finefreeze"

#: rooms from the bottom up; a room may import the rooms before it (its row too)
LAYERS = [
    {"_errors", "_version", "_kinds", "_imports", "_keras"},  # the foundation
    {"_backends"},
    {"_plan"},
    {"_resolve"},
    {"_slices"},
    {"_enforce"},
    {"_optimizer"},
    {"_report", "_files", "_tf1"},
    {"_freezer"},
    {"_select"},
    {"_callbacks"},
    {"_data", "_hub"},
    {"_cli"},
    {"__init__", "__main__", "callbacks", "tf1"},  # the public namespace
]
RANK = {room: i for i, row in enumerate(LAYERS) for room in row}

#: function-local imports of our own modules, and why each is not at the top
LOCAL_IMPORTS = {
    # imports TensorFlow's tf.compat.v1 pieces: only once TensorFlow is imported (a graph target is refused)
    ("finefreeze._freezer.base", "finefreeze._tf1.target"),
    # imports torch at its top: only once a step runs on PyTorch (the interface's modules are all imported
    # by its test, on every backend); a class made in the step instead would split a torch.compile'd one
    ("finefreeze._backends.torch", "finefreeze._backends.torch.autograd_function"),
    # the console script catches Ctrl-C and SIGTERM before the command line's modules load
    ("finefreeze._cli.entry", "finefreeze._cli.commands"),
}
#: modules whose local imports are all deliberate: the command line imports Keras only once a command runs
LAZY_MODULES = {
    "finefreeze._cli.commands",
    "finefreeze._cli.deltas",
    "finefreeze._cli.inputs",
    "finefreeze._cli.finetune",
    "finefreeze._cli.quantize",
}


def _modules():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        yield "finefreeze." + ".".join(parts), path


MODULES = dict(_modules())


def _room(module: str) -> str:
    return module.split(".")[1]


def _imports(module: str, path: pathlib.Path):
    """``(imported module, line, local?)`` for every import of a finefreeze module."""
    tree = ast.parse(path.read_text())
    in_function = {
        id(inner)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for inner in ast.walk(fn)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("finefreeze"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                target = sub if sub in MODULES else node.module
                yield target, node.lineno, id(node) in in_function, alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("finefreeze"):
                    yield alias.name, node.lineno, id(node) in in_function, None


def _edges():
    out = {}
    for module, path in MODULES.items():
        out[module] = [(t, line, local, name) for t, line, local, name in _imports(module, path) if t != module]
    return out


EDGES = _edges()


def _cycles():
    graph = {m: sorted({t for t, *_ in EDGES[m] if t in MODULES and t != "finefreeze"}) for m in MODULES}
    seen, stack, on, found = set(), [], set(), []

    def visit(m):
        seen.add(m)
        stack.append(m)
        on.add(m)
        for t in graph[m]:
            if t in on:
                found.append(stack[stack.index(t) :] + [t])
            elif t not in seen:
                visit(t)
        stack.pop()
        on.discard(m)

    for m in graph:
        if m not in seen:
            visit(m)
    return found


def test_every_module_is_in_a_room_of_the_layering():
    rooms = {_room(m) for m in MODULES if m != "finefreeze"}
    assert rooms <= set(RANK), f"rooms missing from LAYERS: {sorted(rooms - set(RANK))}"
    flat = [
        m
        for m, path in MODULES.items()
        if path.parent == SRC and path.name != "__init__.py" and _room(m) not in LAYERS[0] | LAYERS[-1]
    ]
    assert not flat, f"modules outside a room: {flat}"


def test_no_import_cycles_counting_local_imports():
    assert _cycles() == []


def test_imports_follow_the_layering():
    bad = []
    for module, edges in EDGES.items():
        if module == "finefreeze":
            continue
        for target, line, _, _ in edges:
            if target == "finefreeze":
                if RANK[_room(module)] < RANK["_cli"]:  # the public names sit above every room but the command line
                    bad.append(f"{module}:{line} imports the public package finefreeze (it sits above {_room(module)})")
                continue
            if RANK[_room(target)] > RANK[_room(module)]:
                bad.append(f"{module}:{line} imports {target} (room {_room(target)} is above {_room(module)})")
    assert bad == []


def test_local_imports_only_for_backends_and_optional_pieces():
    bad = [
        f"{module}:{line} imports {target} inside a function"
        for module, edges in EDGES.items()
        for target, line, local, _ in edges
        if local and module not in LAZY_MODULES and (module, target) not in LOCAL_IMPORTS
    ]
    assert bad == []


def _own_private_names() -> dict[str, set[str]]:
    """Module -> the private names it defines (functions, classes, slots, attributes set on self)."""
    out: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        names = out.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name.startswith("_"):
                names.add(node.name)
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__slots__" for t in node.targets):
                names.update(e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant))
            elif (
                isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "__setattr__" and len(node.args) > 1
            ):
                if isinstance(node.args[1], ast.Constant):
                    names.add(node.args[1].value)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr.startswith("_"):
                    names.add(node.attr)
    return {
        room: {n for n in names if isinstance(n, str) and n.startswith("_") and not n.startswith("__")}
        for room, names in out.items()
    }


def _reach_ins():
    """Uses of a private name that another room defines and this module does not (a room's modules are friends)."""
    own = _own_private_names()
    found = []
    for module, path in MODULES.items():
        room = _room(module) if module != "finefreeze" else "__init__"
        others = set().union(*(names for m, names in own.items() if _room(m) != room)) - own[module]
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in others:
                base = node.value
                if not (isinstance(base, ast.Name) and base.id in ("self", "cls")):
                    found.append((module, node.lineno, node.attr, lines[node.lineno - 1]))
        for target, line, _, name in EDGES.get(module, ()):
            if name and name.startswith("_") and not name.startswith("__") and target != "finefreeze":
                if _room(target) != room and f"{target}.{name}" not in MODULES:
                    found.append((module, line, name, lines[line - 1]))
    return found


def _documented_protocol() -> set[str]:
    """The private names docs/architecture.md lists under "The private protocol"."""
    text = (SRC.parent.parent / "docs" / "architecture.md").read_text()
    section = text[text.index("## The private protocol") :]
    return set(re.findall(r"`(_[a-z]\w*)", section))


def test_private_names_cross_rooms_only_as_the_documented_protocol():
    """Every cross-room use of a private name is in the protocol the architecture page lists, and each listed name is used."""
    used = {name for _, _, name, _ in _reach_ins()}
    documented = _documented_protocol()
    undocumented = sorted(f"{m}:{line} uses {name}" for m, line, name, _ in _reach_ins() if name not in documented)
    assert undocumented == [], "list the name in docs/architecture.md (The private protocol), or keep it in its room"
    assert sorted(documented - used) == [], "the architecture page lists names no other room uses"


def test_no_module_is_longer_than_400_lines():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def _body_lines(fn) -> int:
    """Lines of a function's body, its signature and docstring left out."""
    body = fn.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0].value, "value", None), str):
        body = body[1:]
    return fn.end_lineno - body[0].lineno + 1


def test_no_function_is_longer_than_60_lines():
    long = {
        f"{m}.{node.name}": _body_lines(node)
        for m, p in MODULES.items()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _body_lines(node) > 60
    }
    assert long == {}


#: the one room that may touch Keras' private names, import ``keras.src`` and set attributes on Keras' objects
SEAM = "_keras"
#: private names of the standard library finefreeze uses (not Keras')
NOT_KERAS = {"_exit", "_initializing"}
#: what asks which Keras backend runs: only ``_backends`` may
BACKEND_QUESTIONS = {"keras_backend", "keras_is_tensorflow", "tensorflow"}
#: the environment questions any room may ask (none branches on the Keras backend; backend_record names it for a record)
ANY_ROOM_MAY_ASK = {"tensorflow_imported", "tensorflow_installed", "is_variable", "is_module", "backend_record"}
#: rooms that name the frameworks for another reason than branching on the backend in force
NAMES_FRAMEWORKS = {"_backends", "_cli"}  # the command line names what to install and what KERAS_BACKEND says
#: what mutates a dict in place
MUTATORS = {"pop", "popitem", "update", "clear", "setdefault", "__setitem__", "__delitem__"}


def _all_own_private_names() -> set[str]:
    """The private names finefreeze defines outside the seam (the seam's are Keras')."""
    names = set().union(*(n for m, n in _own_private_names().items() if m == "finefreeze" or _room(m) != SEAM))
    for module, path in MODULES.items():
        if module != "finefreeze" and _room(module) == SEAM:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name) and t.id.startswith("_"))
            elif (
                isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_finefreeze")
            ):
                names.add(node.value)
    return names


def _private(name) -> bool:
    return isinstance(name, str) and name.startswith("_") and not name.startswith("__")


def _outside_the_seam():
    for module, path in MODULES.items():
        if module == "finefreeze" or _room(module) != SEAM:
            yield module, path, ast.parse(path.read_text())


def _is_self(node) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def _instance_dict(node) -> bool:
    """Whether ``node`` is ``x.__dict__`` or ``vars(x)`` of an ``x`` other than ``self``."""
    if isinstance(node, ast.Attribute) and node.attr == "__dict__":
        return not _is_self(node.value)
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "vars" and node.args:
        return not _is_self(node.args[0])
    return False


def _patches(node) -> str | None:
    """What ``node`` writes past another object's attribute handling, or None."""
    if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)) and _instance_dict(node.value):
        return "writes an instance's __dict__"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr in MUTATORS and _instance_dict(node.func.value):
            return f"changes an instance's __dict__ ({node.func.attr})"
    if isinstance(node, ast.Call):
        name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
        first = node.args[0] if node.args else None
        on_object = isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", None) == "object"
        if name in ("__setattr__", "__delattr__") and on_object and not _is_self(first):
            return f"object.{name} on another object"
        if name in ("setattr", "delattr") and len(node.args) > 1 and not _is_self(first):
            key = node.args[1]
            if isinstance(key, ast.Constant) and _private(key.value) and not key.value.startswith("_finefreeze"):
                return f"{name} {key.value}"
    return None


def _keras_private_uses() -> list[str]:
    """Keras' private names, ``keras.src`` imports and attribute writes past Keras, outside the seam."""
    ours, found = _all_own_private_names(), []
    for module, _, tree in _outside_the_seam():
        for node in ast.walk(tree):
            where = f"{module}:{getattr(node, 'lineno', 0)}"
            patch = _patches(node)
            if patch:
                found.append(f"{where} {patch}")
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in ours | NOT_KERAS:
                found.append(f"{where} uses {node.attr}")
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras.src"):
                found.append(f"{where} imports {node.module}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("keras.src") for a in node.names):
                found.append(f"{where} imports keras.src")
            elif isinstance(node, ast.Call) and len(node.args) > 1:
                name = getattr(node.func, "id", None)
                key = node.args[1]
                if name in ("getattr", "hasattr", "setattr", "delattr") and isinstance(key, ast.Constant):
                    if _private(key.value) and key.value not in ours | NOT_KERAS:
                        found.append(f"{where} {name} {key.value}")
    return found


def test_keras_private_names_and_instance_patches_only_in_the_seam():
    assert _keras_private_uses() == []


def test_no_writes_to_another_objects_private_attributes():
    found = [
        f"{module}:{node.lineno} sets {node.attr}"
        for module, _, tree in _outside_the_seam()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, (ast.Store, ast.Del))
        and _private(node.attr)
        and not _is_self(node.value)
    ]
    assert found == []


def _backend_questions() -> list[str]:
    found = []
    for module, path in MODULES.items():
        room = "__init__" if module == "finefreeze" else _room(module)
        if room == "_backends":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{module}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call):
                fn = node.func
                if getattr(fn, "id", None) in BACKEND_QUESTIONS or getattr(fn, "attr", None) in BACKEND_QUESTIONS:
                    found.append(f"{where} asks {getattr(fn, 'id', None) or fn.attr}()")
                if (
                    isinstance(fn, ast.Attribute)
                    and fn.attr == "backend"
                    and getattr(fn.value, "attr", "") == "backend"
                ):
                    found.append(f"{where} asks keras.backend.backend()")
            elif isinstance(node, ast.ImportFrom) and node.module == "finefreeze._backends.questions":
                found += [f"{where} imports {a.name}" for a in node.names if a.name not in ANY_ROOM_MAY_ASK]
            elif isinstance(node, ast.Compare) and room not in NAMES_FRAMEWORKS:
                names = [c.value for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                if any(n in ("tensorflow", "jax", "torch") for n in names):
                    found.append(f"{where} compares with a backend's name")
    return found


def test_backend_questions_only_in_backends():
    assert _backend_questions() == []


@pytest.mark.slow
def test_the_seam_checks_catch_what_they_guard(monkeypatch, tmp_path):
    """Each check fails on a violation planted in a module outside its room."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import keras.src.utils\n"
        "def f(opt, layer, frz, v):\n"
        "    layer.__dict__['call'] = print\n"
        "    vars(opt).update(x=1)\n"
        "    object.__setattr__(opt, '_iterations', 0)\n"
        "    opt._trainable_variables_indices = {}\n"
        "    frz._held.add(1)\n"
        "    getattr(v, '_layout', None)\n"
        "    if keras.backend.backend() == 'jax':\n"
        "        return opt._var_key(layer), keras_backend()\n" + "    x = 1\n" * 61 + "#\n" * 330
    )
    monkeypatch.setitem(MODULES, "finefreeze._plan.bad", bad)
    uses = " ".join(_keras_private_uses())
    for what in ("imports keras.src", "writes an instance's __dict__", "(update)", "object.__setattr__", "_var_key"):
        assert what in uses, what
    assert "_held" in {name for _, _, name, _ in _reach_ins()}
    questions = " ".join(_backend_questions())
    assert "keras.backend.backend()" in questions and "keras_backend()" in questions and "name" in questions
    for check in (
        test_private_names_cross_rooms_only_as_the_documented_protocol,
        test_no_writes_to_another_objects_private_attributes,
        test_no_module_is_longer_than_400_lines,
        test_no_function_is_longer_than_60_lines,
    ):
        with pytest.raises(AssertionError):
            check()


def test_the_checks_catch_what_they_guard(tmp_path):
    """A cycle and an upward import are seen (the checks themselves can fail)."""
    global EDGES
    saved = EDGES
    try:
        EDGES = {m: list(e) for m, e in saved.items()}
        EDGES["finefreeze._plan.rules"].append(("finefreeze._freezer.freezer", 1, False, "Freezer"))
        EDGES["finefreeze._freezer.freezer"].append(("finefreeze._plan.rules", 1, False, "freeze"))
        with pytest.raises(AssertionError):
            test_imports_follow_the_layering()
        assert _cycles() != []
        EDGES["finefreeze._plan.plan"].append(("finefreeze._resolve.resolve", 9, True, "resolve"))
        with pytest.raises(AssertionError):
            test_local_imports_only_for_backends_and_optional_pieces()
    finally:
        EDGES = saved
