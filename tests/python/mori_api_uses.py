"""Finds every use of the `mori` API in a serving engine's source with `ast`
and checks it against mori_torch: each imported name, each attribute read on
a mori object, each call's positional count and keyword names.

Which expressions hold mori objects is inferred, module-wide and
flow-insensitively, from:
- assignments from mori constructors and from mori methods (their return
  annotations in mori_torch.io: create_session -> IOEngineSession, ...);
- annotations (``statuses: List[TransferStatus]``), loops and
  comprehensions over typed lists;
- attribute names: ``self.moriio_engine = IOEngine(...)`` in one class types
  ``x.moriio_engine`` everywhere in the package;
- duck typing: a receiver on which a method only one mori class has is
  called (``self.engine.register_memory``) holds that class;
- names: an untyped receiver named like a session (``session``,
  ``self.sessions[i]``) of a session method holds an IOEngineSession.
Annotations are not uses (they are not evaluated at run time).
Used by tests/python/test_mori_compat.py.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from typing import Dict, List, Optional, Set, Tuple

import mori_torch.io as io

MORI_MODULES = ("mori", "mori.io", "mori.cpp")
LOCAL = "<the package's own class>"


def _exported(module: str) -> Dict[str, object]:
    import _mori_torch_alias

    names = list(io.__all__)
    if module == "mori.cpp":
        names = [n for n in names if n not in _mori_torch_alias._CPP_ONLY_UPSTREAM]
    return {n: getattr(io, n) for n in names} if module != "mori" else {}


CLASSES = {n: getattr(io, n) for n in io.__all__ if inspect.isclass(getattr(io, n))}


def _methods(cls) -> Set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


# Upstream mori.io methods that only one class has: a receiver they are
# called on holds that class. (mori_torch's own extras such as shutdown()
# are left out: serving code calls its own objects' shutdown().)
UPSTREAM_UNIQUE = {
    "IOEngine": ("get_engine_desc", "create_backend", "remove_backend", "register_remote_engine",
                 "deregister_remote_engine", "register_memory", "register_torch_tensor", "deregister_memory",
                 "create_session", "pop_inbound_transfer_status", "wait_all"),
    "TransferStatus": ("Code", "Message", "Init", "InProgress", "Succeeded", "Failed", "SetCode", "SetMessage",
                       "WaitFor", "WaitBusy"),
}


SESSION_METHODS = ("read", "write", "batch_read", "batch_write", "allocate_transfer_uid", "alive")


def _named_like_session(node) -> bool:
    while isinstance(node, ast.Subscript):
        node = node.value
    name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else ""
    return "sess" in name.lower()


def _unique_methods() -> Dict[str, str]:
    return {m: c for c, ms in UPSTREAM_UNIQUE.items() for m in ms}


UNIQUE = _unique_methods()


def _return_type(cname: str, method: str) -> Optional[Tuple[str, bool]]:
    """(class name, is_list) of what cls.method returns, from its annotations."""
    fn = getattr(CLASSES[cname], method, None)
    if fn is None:
        return None
    if method == "unpack":
        return cname, False
    try:
        hint = typing.get_type_hints(inspect.unwrap(fn), vars(io)).get("return")
    except Exception:
        return None
    is_list = False
    for _ in range(3):
        origin = typing.get_origin(hint)
        if origin is typing.Union:
            hint = next((a for a in typing.get_args(hint) if a is not type(None)), None)
        elif origin in (list, List):
            hint, is_list = typing.get_args(hint)[0], True
        else:
            break
    for n, c in CLASSES.items():
        if hint is c:
            return n, is_list
    return None


@dataclasses.dataclass
class Use:
    file: str
    line: int
    what: str  # "Class.member" or "module.Name"
    call: str  # "" (attribute) or "(n positional, kw=...)"
    ok: bool
    problem: str = ""
    how: str = ""  # how the receiver's type was known


def _ann_type(node) -> Optional[Tuple[str, bool]]:
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            node = ast.parse(node.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(node, ast.Name) and node.id in CLASSES:
        return node.id, False
    if isinstance(node, ast.Subscript):
        base = ast.unparse(node.value).split(".")[-1]
        inner = _ann_type(node.slice)
        if inner and base in ("List", "list", "Sequence", "Iterable"):
            return inner[0], True
        if inner and base == "Optional":
            return inner
    return None


class _Module:
    def __init__(self, path: str, source: str):
        self.path = path
        self.tree = ast.parse(source, filename=path)
        self.imported: Dict[str, Tuple[str, str]] = {}  # local name -> (module, name)


def analyze(sources: Dict[str, str]) -> List[Use]:
    """sources: path -> text of one package's files. Returns every use found."""
    mods = [_Module(p, s) for p, s in sources.items()]
    uses: List[Use] = []
    # Classes the package defines itself: their instances are not mori objects
    # even when they have a method of the same name (vLLM's MoRIIOWrapper).
    local_classes = {n.name for m in mods for n in ast.walk(m.tree) if isinstance(n, ast.ClassDef)}
    for m in mods:
        for node in ast.walk(m.tree):
            if isinstance(node, ast.ImportFrom) and node.module in MORI_MODULES:
                for a in node.names:
                    exported = _exported(node.module)
                    ok = a.name in exported
                    uses.append(Use(m.path, node.lineno, f"{node.module}.{a.name}", "", ok,
                                    "" if ok else f"{node.module} has no {a.name}"))
                    if ok and inspect.isclass(exported[a.name]):
                        m.imported[a.asname or a.name] = (node.module, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "mori":
                        uses.append(Use(m.path, node.lineno, f"import {a.name}", "", a.name in MORI_MODULES,
                                        "" if a.name in MORI_MODULES else f"{a.name} is not provided"))

    # Types: expression text -> (class, is_list); attribute names across the package.
    types: Dict[Tuple[str, str], Tuple[str, bool]] = {}  # (path, expr text) -> type
    attr_types: Dict[str, Tuple[str, bool]] = {}  # ".attr" -> type
    how: Dict[Tuple[str, str], str] = {}

    def type_of(m: _Module, node) -> Optional[Tuple[str, bool]]:
        if node is None:
            return None
        if isinstance(node, ast.Name) and node.id in m.imported:
            return None  # the class itself, not an instance
        if isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in m.imported:
                return m.imported[f.id][1], False
            if isinstance(f, ast.Name) and f.id in local_classes:
                return LOCAL, False
            if isinstance(f, ast.Attribute):
                if isinstance(f.value, ast.Name) and f.value.id in m.imported:
                    return _return_type(m.imported[f.value.id][1], f.attr)
                t = type_of(m, f.value)
                if t and not t[1] and t[0] != LOCAL:
                    return _return_type(t[0], f.attr)
            return None
        if isinstance(node, ast.Subscript):
            t = type_of(m, node.value)
            if t and t[1]:
                return t[0], False
        text = ast.unparse(node)
        if (m.path, text) in types:
            return types[(m.path, text)]
        if isinstance(node, ast.Attribute) and "." + node.attr in attr_types:
            return attr_types["." + node.attr]
        return None

    def assign(m: _Module, target, t, why: str) -> bool:
        if t is None:
            return False
        key = (m.path, ast.unparse(target))
        if key in types:
            return False
        types[key], how[key] = t, why
        if isinstance(target, ast.Attribute):
            attr_types.setdefault("." + target.attr, t)
        return True

    for _ in range(4):  # to a fixpoint: types flow through assignments
        changed = False
        for m in mods:
            for node in ast.walk(m.tree):
                if isinstance(node, ast.Assign):
                    t = type_of(m, node.value)
                    for tgt in node.targets:
                        changed |= assign(m, tgt, t, "assignment")
                elif isinstance(node, ast.AnnAssign):
                    changed |= assign(m, node.target, _ann_type(node.annotation) or type_of(m, node.value),
                                      "annotation")
                elif isinstance(node, ast.arg):
                    changed |= assign(m, ast.Name(node.arg), _ann_type(node.annotation), "annotation")
                elif isinstance(node, (ast.For, ast.comprehension)):
                    t = type_of(m, node.iter)
                    if t and t[1]:
                        changed |= assign(m, node.target, (t[0], False), "loop over a typed list")
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                    cname = UNIQUE.get(node.func.attr)
                    recv = node.func.value
                    if (cname is None and node.func.attr in SESSION_METHODS and _named_like_session(recv)
                            and type_of(m, recv) is None):
                        changed |= assign(m, recv, ("IOEngineSession", False), "named like a session")
                        continue
                    if cname and type_of(m, recv) is None and not (isinstance(recv, ast.Name)
                                                                   and recv.id in ("self", "cls")):
                        changed |= assign(m, recv, (cname, False), f"calls {node.func.attr}(), only on {cname}")
        if not changed:
            break

    def check_member(m, node, cname: str, attr: str, call, why: str):
        cls = CLASSES[cname]
        what = f"{cname}.{attr}"
        if not hasattr(cls, attr) and not (dataclasses.is_dataclass(cls) and attr in
                                           {f.name for f in dataclasses.fields(cls)}):
            uses.append(Use(m.path, node.lineno, what, "", False, f"{cname} has no attribute {attr!r}", why))
            return
        if call is None:
            uses.append(Use(m.path, node.lineno, what, "", True, "", why))
            return
        uses.append(_check_call(m.path, node.lineno, what, getattr(cls, attr), call, bound=True, how=why))

    for m in mods:
        in_annotations = {id(d) for n in ast.walk(m.tree)
                          for a in (getattr(n, "annotation", None), getattr(n, "returns", None)) if a is not None
                          for d in ast.walk(a)}
        for node in ast.walk(m.tree):
            if id(node) in in_annotations:
                continue
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in m.imported:
                cname = m.imported[node.func.id][1]
                uses.append(_check_call(m.path, node.lineno, f"{cname}(...)", CLASSES[cname], node, bound=False,
                                        how="constructor"))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                t = type_of(m, node.args[0])
                if t and not t[1] and t[0] != LOCAL:
                    check_member(m, node, t[0], node.args[1].value, None, "getattr")
            elif isinstance(node, ast.Attribute):
                parent_call = getattr(node, "_call", None)
                if isinstance(node.value, ast.Name) and node.value.id in m.imported:
                    check_member(m, node, m.imported[node.value.id][1], node.attr, parent_call, "class attribute")
                    continue
                t = type_of(m, node.value)
                if t and not t[1] and t[0] != LOCAL:
                    key = (m.path, ast.unparse(node.value))
                    check_member(m, node, t[0], node.attr, parent_call,
                                 how.get(key) or ("attribute name" if isinstance(node.value, ast.Attribute)
                                                  else "return type"))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                node.func._call = node  # lets the Attribute visit see its call
    return uses


def _check_call(path, line, what, target, call: ast.Call, bound: bool, how: str) -> Use:
    npos = len(call.args)
    star = any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords)
    kws = [k.arg for k in call.keywords if k.arg is not None]
    desc = f"({npos} positional{', ' if kws else ''}{', '.join(k + '=' for k in kws)})"
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError) as e:
        return Use(path, line, what, desc, False, f"no signature: {e}", how)
    params = list(sig.parameters.values())
    if bound and params and params[0].name == "self":
        params = params[1:]
    sig = sig.replace(parameters=params)
    try:
        if star:
            names = {p.name for p in params}
            has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
            bad = [k for k in kws if k not in names and not has_var_kw]
            if bad:
                raise TypeError(f"unexpected keyword {bad[0]!r}")
        else:
            sig.bind(*range(npos), **{k: None for k in kws})
    except TypeError as e:
        return Use(path, line, what, desc, False, f"does not bind to {what.split('(')[0]}{sig}: {e}", how)
    return Use(path, line, what, desc, True, "", how)
