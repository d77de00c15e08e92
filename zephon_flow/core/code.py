"""The identity of user code in the fingerprint: normalised source text, bytecode as a fallback.

A function or DoFn class is identified by its parsed source (``ast``), so comments, blank
lines, indentation and docstrings do not count, and the same source gives the same digest on
every Python version (the dump below leaves out empty fields, which newer versions add).
Where no source can be found (code built at run time, a ``python -c`` one-liner) the
bytecode stands in; bytecode differs between Python minor versions, so such code refuses
checkpoints across a Python upgrade, and only such code.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import linecache
import os
import sys
import sysconfig
import textwrap
import types
from typing import Any

#: Modules whose code is versioned with the package, not with the user's pipeline.
_LIBRARY = ("apache_beam", "zephon_flow", "builtins")


def _dump(node: Any) -> str:
    """A version-independent dump of an AST: node names and their non-empty fields."""
    if isinstance(node, ast.AST):
        fields = []
        for name, value in ast.iter_fields(node):
            if value is None or value == [] or name in ("type_comment", "kind"):
                continue
            fields.append(f"{name}={_dump(value)}")
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_dump(v) for v in node) + "]"
    return repr(node)


def _strip_docstrings(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                node.body = body[1:] or [ast.Pass()]


def _parse(text: str) -> ast.Module | None:
    text = textwrap.dedent(text)
    for candidate in (text, f"(\n{text}\n)"):
        try:
            return ast.parse(candidate)
        except SyntaxError:
            continue
    return None


def _lambda_source(fn: types.FunctionType) -> str | None:
    """The lambdas that start on ``fn``'s line of its file (a lambda has no source of its own)."""
    linecache.checkcache(fn.__code__.co_filename)
    lines = linecache.getlines(fn.__code__.co_filename)
    if not lines:
        return None
    try:
        tree = ast.parse("".join(lines))
    except SyntaxError:
        return None
    first = fn.__code__.co_firstlineno
    lambdas = [n for n in ast.walk(tree) if isinstance(n, ast.Lambda) and n.lineno == first]
    arity = fn.__code__.co_argcount + fn.__code__.co_kwonlyargcount
    same = [n for n in lambdas if len(n.args.args) + len(n.args.kwonlyargs) == arity]
    # Several lambdas on one line with the same arity: all of them count (an edit to a
    # neighbour refuses too, which is safe; accepting a changed one would not be).
    return ";".join(_dump(n) for n in same) or None


def source_digest(obj: Any) -> str | None:
    """A digest of the normalised source of a function or class, or None if it has none."""
    if isinstance(obj, types.FunctionType) and obj.__name__ == "<lambda>":
        dumped = _lambda_source(obj)
    else:
        try:
            text = inspect.getsource(obj)
        except (OSError, TypeError):
            return None
        tree = _parse(text)
        if tree is None:
            return None
        _strip_docstrings(tree)
        dumped = _dump(tree)
    if dumped is None:
        return None
    return hashlib.sha256(dumped.encode("utf-8")).hexdigest()


def _stable_repr(value: Any) -> str:
    """``repr`` with sets sorted (their order depends on the hash seed)."""
    if isinstance(value, frozenset | set):
        return "{" + ",".join(sorted(_stable_repr(v) for v in value)) + "}"
    if isinstance(value, tuple):
        return "(" + ",".join(_stable_repr(v) for v in value) + ")"
    return repr(value)


def bytecode_digest(code: types.CodeType) -> str:
    """The fallback: bytecode, constants and names, through nested code objects."""
    h = hashlib.sha256()

    def feed(c: types.CodeType) -> None:
        h.update(c.co_code)
        h.update(repr(c.co_names).encode())
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                feed(const)
            else:
                h.update(_stable_repr(const).encode() + b";")

    feed(code)
    return h.hexdigest()


def function_code_digest(fn: types.FunctionType) -> str:
    """``source:<digest>`` from the function's source, else ``bytecode:<digest>``."""
    digest = source_digest(fn)
    if digest is not None:
        return f"source:{digest[:16]}"
    return f"bytecode:{bytecode_digest(fn.__code__)[:16]}"


def global_names(code: types.CodeType) -> list[str]:
    """The names a code object and its nested code use, sorted (stable across versions)."""
    names: set[str] = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(global_names(const))
    return sorted(names)


def user_classes(cls: type) -> list[type]:
    """The classes of ``cls``'s MRO that belong to the user, not to Beam, zephon-flow or Python."""
    return [c for c in cls.__mro__ if not _is_library(c.__module__)]


def _is_library(module: str) -> bool:
    top = module.split(".")[0]
    return top in _LIBRARY or top in sys.stdlib_module_names


def class_code_digest(cls: type) -> str | None:
    """The digest of a user DoFn class's code (its own and its user base classes'), or None
    for a class of Beam or zephon-flow."""
    classes = user_classes(cls)
    if not classes:
        return None
    h = hashlib.sha256()
    for c in classes:
        digest = source_digest(c)
        if digest is None:
            methods = sorted((name, v) for name, v in vars(c).items() if isinstance(v, types.FunctionType))
            digest = "bytecode:" + ",".join(f"{n}={bytecode_digest(f.__code__)}" for n, f in methods)
        h.update(f"{c.__qualname__}={digest};".encode())
    return h.hexdigest()[:16]


# -- what a DoFn's code reaches ------------------------------------------------------------
#: Types whose values a module-level constant may hold to count as one (plain data).
_PLAIN = (int, float, complex, str, bytes, bool, type(None))


@functools.lru_cache(maxsize=1)
def _installed_dirs() -> tuple[str, ...]:

    dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    return tuple(sorted(os.path.join(os.path.realpath(d), "") for d in dirs))


def is_user_module(name: str) -> bool:
    """Whether module ``name`` is the user's code: not the standard library, Beam, zephon-flow
    or an installed package (a file under the interpreter's or an environment's library or
    site-packages folders), and loaded from a file; ``__main__`` always (a script, or a
    notebook's cells, which have no file)."""
    if name == "__main__":
        return True
    if not name or _is_library(name):
        return False
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if not isinstance(path, str):
        return False
    real = os.path.realpath(path)
    if f"{os.sep}site-packages{os.sep}" in real or f"{os.sep}dist-packages{os.sep}" in real:
        return False
    return not real.startswith(_installed_dirs())


def _constant_repr(value: Any) -> str | None:
    """A process-independent repr of plain data (sets sorted), or None for anything else."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, tuple | list):
        parts = [_constant_repr(v) for v in value]
        return None if None in parts else f"{type(value).__name__}({','.join(p or '' for p in parts)})"
    if isinstance(value, frozenset | set):
        parts = [_constant_repr(v) for v in value]
        return None if None in parts else "set(" + ",".join(sorted(p or "" for p in parts)) + ")"
    if isinstance(value, dict):
        items = [(_constant_repr(k), _constant_repr(v)) for k, v in value.items()]
        if any(k is None or v is None for k, v in items):
            return None
        return "dict(" + ",".join(f"{k}:{v}" for k, v in items) + ")"
    return None


def _code_objects(cls: type) -> list[types.CodeType]:
    """The code of a class's own methods (plain, static, class methods and properties)."""
    out: list[types.CodeType] = []
    for _, value in sorted(vars(cls).items(), key=lambda kv: kv[0]):
        for fn in (
            value,
            getattr(value, "__func__", None),
            getattr(value, "fget", None),
            getattr(value, "fset", None),
        ):
            if isinstance(fn, types.FunctionType):
                out.append(fn.__code__)
    return out


def _nonlocal_names(code: types.CodeType) -> set[str]:
    """Bytecode's names of ``code`` and its nested code that are not its own locals (an
    attribute ``self.text`` of a function with a parameter ``text`` is left out)."""
    own = set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)
    names = set(code.co_names) - own
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _nonlocal_names(const)
    return names


def _loaded_names(owner: Any) -> set[str] | None:
    """The names a function's or class's source reads as bare names (``ast.Name``), or None
    where it has no source."""
    if owner is None:
        return None
    try:
        tree = _parse(inspect.getsource(owner))
    except (OSError, TypeError):
        return None
    if tree is None:
        return None
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


class _Reach:
    """Walks from code to the module-level functions, classes and constants of the user's
    modules it names, transitively (each object once, so recursion ends)."""

    def __init__(self) -> None:
        self.parts: dict[str, str] = {}
        self.seen: set[int] = set()

    def code(
        self, codes: list[types.CodeType], namespace: dict[str, Any], module: str, owner: Any = None
    ) -> None:
        """Follows the module-level names ``codes`` read. Bytecode's names are the globals
        read and every attribute name (``self.text``); where ``owner`` (the function or class
        the code is) has source, only those also read as a bare name count as globals, so an
        attribute never brings a global that happens to share its name."""
        names: set[str] = set()
        for c in codes:
            names.update(global_names(c))
        loads = _loaded_names(owner)
        free: set[str] = set()  # names not local to the code object that reads them
        for c in codes:
            free.update(_nonlocal_names(c))
        for name in sorted(names if loads is None else free & loads):
            if name in namespace:
                self.value(name, namespace[name], module, names)

    def value(self, name: str, value: Any, module: str, names: set[str]) -> None:
        if isinstance(value, types.ModuleType):
            if is_user_module(value.__name__) and id(value) not in self.seen:
                # ``helpers.cut``: the attributes of a user module that the code names.
                self.seen.add(id(value))
                space = vars(value)
                for attr in sorted(names):
                    if attr in space and not isinstance(space[attr], types.ModuleType):
                        self.value(attr, space[attr], value.__name__, names)
            return
        if isinstance(value, types.FunctionType):
            self.function(value)
            return
        if isinstance(value, type):
            self.klass(value)
            return
        plain = _constant_repr(value)
        if plain is not None:
            if is_user_module(module):
                digest = hashlib.sha256(plain.encode("utf-8")).hexdigest()[:16]
                self.parts[f"constant {name} in module {module}"] = digest
            return
        if isinstance(type(value), type) and is_user_module(type(value).__module__):
            self.klass(type(value))  # an instance of the user's class: its class's code

    def function(self, fn: types.FunctionType) -> None:
        if id(fn) in self.seen or not is_user_module(fn.__module__):
            return
        self.seen.add(id(fn))
        h = hashlib.sha256(function_code_digest(fn).encode())
        for i, default in enumerate(fn.__defaults__ or ()):
            h.update(f";default {i}={_constant_repr(default)}".encode())
        self.parts[f"helper {fn.__qualname__} in module {fn.__module__}"] = h.hexdigest()[:16]
        self.code([fn.__code__], fn.__globals__, fn.__module__, None if fn.__name__ == "<lambda>" else fn)

    def klass(self, cls: type) -> None:
        if id(cls) in self.seen or not is_user_module(cls.__module__):
            return
        self.seen.add(id(cls))
        digest = class_code_digest(cls)
        if digest is not None:
            self.parts[f"class {cls.__qualname__} in module {cls.__module__}"] = digest
        self.dofn_class(cls)

    def dofn_class(self, cls: type) -> None:
        classes = user_classes(cls)
        self.seen.update(id(c) for c in classes)  # their own code is digested by the caller
        for c in classes:
            module = sys.modules.get(c.__module__)
            if module is not None:
                self.code(_code_objects(c), vars(module), c.__module__, c)


def reached_code(cls: type, instance: Any = None) -> dict[str, str]:
    """What the code of a user's DoFn class reaches, by name, with a digest of each: the
    module-level functions (``helper cut in module m``), classes (``class Tok in module m``)
    and plain constants (``constant LIMIT in module m``) of the user's modules that its
    methods name, and what those name in turn; not into the standard library, installed
    packages, Beam or zephon-flow. A function is identified as ``function_code_digest`` does
    (its parsed source) with its defaults; a constant by its value. Functions and classes of
    the user's modules that ``instance``'s attributes hold (``MyDoFn(fn=cut)``) count too.
    Empty for a class of Beam or zephon-flow."""
    walk = _Reach()
    walk.dofn_class(cls)
    for name, value in sorted(vars(instance).items()) if hasattr(instance, "__dict__") else ():
        if isinstance(value, types.FunctionType | type):
            walk.value(name, value, cls.__module__, set())
    return dict(sorted(walk.parts.items()))


def makes_constant_keyed_pairs(fn: Any) -> bool:
    """Whether a function (a lambda or a ``def``) returns ``(constant, value)`` pairs: the
    keying a Beam user writes before a stateful DoFn (``beam.Map(lambda t: (0, t))``), read
    from its parsed source (False where there is none)."""
    if not isinstance(fn, types.FunctionType):
        return False
    if fn.__name__ == "<lambda>":
        linecache.checkcache(fn.__code__.co_filename)
        try:
            tree = ast.parse("".join(linecache.getlines(fn.__code__.co_filename)))
        except SyntaxError:
            return False
        line, code = fn.__code__.co_firstlineno, fn.__code__
        names = list(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])
        bodies = [
            n.body
            for n in ast.walk(tree)
            if isinstance(n, ast.Lambda)
            and n.lineno == line
            and [a.arg for a in (*n.args.args, *n.args.kwonlyargs)] == names
        ]
    else:
        try:
            parsed = _parse(inspect.getsource(fn))
        except (OSError, TypeError):
            return False
        if parsed is None:
            return False
        bodies = [n.value for n in ast.walk(parsed) if isinstance(n, ast.Return) and n.value is not None]
    return bool(bodies) and all(
        isinstance(b, ast.Tuple) and len(b.elts) == 2 and isinstance(b.elts[0], ast.Constant) for b in bodies
    )
