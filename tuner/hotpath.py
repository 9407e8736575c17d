"""The hot-path check: defects in the user's own training step, named by file and line.

The performance guides spend half their pages on code no knob can fix: a host sync per
step for logging, ``hasattr`` in ``forward``, an attention mask rebuilt every step, a
graph split by a data-dependent branch. This check runs the user's step as a trial does
and names each one at the innermost line of the workload's own files, with how often
it happens per step, what it cost where that can be measured, and what to do instead.

It runs on items already in memory, so the DataLoader's work is not in it: the hot path
is the step itself (the loss, the model, the optimizer) and the workload's own
``collate``, which runs once per batch. Three
passes, each on its own steps so that one's instrumentation is not in another's figures:

1. ``calls``: a ``TorchFunctionMode`` sees every torch call the user's code makes
   directly: host syncs (``.item()``, ``bool(tensor)``, ``nonzero``...), tensors built
   from constants every step, host-to-device copies (GPU), and autograd's anomaly
   detection left on. It runs on the eager
   module: a mode on the stack is part of what a compiled graph guards on.
2. ``builtins``: ``sys.setprofile`` counts ``hasattr``, ``isinstance`` and ``getattr``
   with a default called from the user's lines, and calls a step should not make
   (``gc.collect()``, ``torch.cuda.empty_cache()``, ``torch.cuda.synchronize()``), and an
   autocast the step turns on itself, which the precision knob cannot undo.
3. ``compile`` (``compile`` on): dynamo's graph breaks with their user frames, and the
   recompiles that go on after the first steps, with the guard that failed.

Calls from the tuner's own loop are never the user's; calls whose innermost caller is
another library (not torch) are summarized by package, apart from the findings.
"""

from __future__ import annotations

import contextlib
import dis
import gc
import logging
import os
import re
import sys
import sysconfig
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

TUNER_DIR = Path(__file__).resolve().parent
TORCH_DIR = Path(torch.__file__).resolve().parent
# The longest first: site-packages lies inside the standard library's folder, and a file
# there is named by its package, not as "site-packages" (a set's order varies per process)
LIBRARY_DIRS = tuple(sorted({str(Path(p).resolve()) for p in (sysconfig.get_paths()["purelib"],
                                                               sysconfig.get_paths()["platlib"],
                                                               sysconfig.get_paths()["stdlib"])},
                            key=len, reverse=True))

# What to do instead, one line per kind (the guides' advice).
FIX = {
    "autocast": "take it out and search the precision knob: the knob puts autocast around the forward and "
                "the loss (a GradScaler with fp16), and the exported config's precision puts it in your script",
    "anomaly": "remove it outside debugging: it keeps every op's traceback for the backward and checks each "
               "backward output for NaN, which on a GPU waits for the device",
    "sync": "keep the value on the device (accumulate into a tensor) and read it every N steps, not every step",
    "branch": "branch on host data, or keep both sides on the device with torch.where",
    "dynamic_size": "use a fixed-size form (torch.where(mask, x, 0), masked_fill, a weighted sum) "
                    "instead of an output whose size depends on the data",
    "hasattr": "decide once in __init__ and store a flag; do not probe attributes every step",
    "getattr": "set the attribute in __init__ so a plain attribute read works",
    "isinstance": "know the batch's structure once (in collate or __init__), not per element per step",
    "invariant": "build it once (in __init__, register_buffer(..., persistent=False)) and reuse it",
    "gc_collect": "drop it from the step: each call scans every object the process holds; to keep the "
                  "collector's full scans out of the loop, freeze what was built before it (gc_freeze)",
    "empty_cache": "drop it from the step: it hands the allocator's cached blocks back to the driver, and the "
                   "next step allocates them again",
    "synchronize": "drop it from the step (it waits for all queued work): read values only where you need "
                   "them, and time with CUDA events",
    "graph_break": "move it out of the compiled code or make it traceable (see the reason)",
    "recompile": "keep what the guard checks the same each step: pad to a few fixed sizes, "
                 "mark the dimension dynamic (torch._dynamo.mark_dynamic), pass tensors not Python numbers",
    "unpinned_copy": "pin the host tensor (tensor.pin_memory()) or create it on the device",
    "blocking_copy": "copy with non_blocking=True from pinned memory",
}

# Tensor methods and torch functions whose result needs the device's values on the host.
SYNCS = {"item": ("sync", ".item()"), "tolist": ("sync", ".tolist()"), "cpu": ("sync", ".cpu()"),
         "numpy": ("sync", ".numpy()"), "__bool__": ("branch", "bool(tensor) (an if on a tensor)"),
         "__int__": ("sync", "int(tensor)"), "__float__": ("sync", "float(tensor)"),
         "__format__": ("sync", "format(tensor) (an f-string of its value)"),
         "__repr__": ("sync", "repr(tensor) (a print of its values)"),
         "nonzero": ("dynamic_size", "nonzero"), "argwhere": ("dynamic_size", "argwhere"),
         "masked_select": ("dynamic_size", "masked_select"), "unique": ("dynamic_size", "unique")}
# Built from constants: the same tensor every step when its arguments are.
FACTORIES = frozenset({"arange", "ones", "zeros", "full", "eye", "linspace", "logspace", "tensor",
                       "as_tensor", "tril_indices", "triu_indices"})
# Calls that return a view of their first argument: a write into the view fills it.
_VIEWS = frozenset({"__getitem__", "view", "narrow", "select", "reshape", "as_strided", "unsqueeze",
                    "squeeze", "transpose", "permute", "flatten", "unflatten", "expand", "t"})
# A small tensor built each step (positions for an embedding, a zero state) costs less
# than keeping it would save; a mask of T x T does not.
INVARIANT_NUMEL = 4096
_MODULE_CALL = ("_call_impl", "_wrapped_call_impl")  # nn.Module.__call__
BUILTINS = {id(hasattr): "hasattr", id(isinstance): "isinstance", id(getattr): "getattr",
            id(gc.collect): "gc_collect"}
# Python functions a step should not call: the profiling hook sees them called from the
# user's lines (their own frame's caller).
CALLS = {torch.cuda.empty_cache.__code__: "empty_cache", torch.cuda.synchronize.__code__: "synchronize"}
_AUTOCAST_ENTER = torch.amp.autocast_mode.autocast.__enter__.__code__
WHAT = {"getattr": "getattr() with a default", "gc_collect": "gc.collect()",
        "empty_cache": "torch.cuda.empty_cache()", "synchronize": "torch.cuda.synchronize()"}


@dataclass
class Finding:
    """One defect at one line of the user's code."""

    kind: str
    where: str  # file:line, the innermost frame in the workload's own files
    function: str
    what: str
    per_step: float | None  # None: once, when compiling
    cost_ms_per_step: float | None
    cost: str  # how the cost was measured, or why it is only a count
    fix: str


@dataclass
class UserCode:
    """Which source files are the workload's own: the folder of its file (not installed
    packages in it), or only the file for a built-in or installed workload."""

    roots: tuple[str, ...] = ()
    files: frozenset[str] = frozenset()
    _seen: dict[str, bool] = field(default_factory=dict, repr=False)

    @classmethod
    def of_workload(cls, ref: str, base_dir: str | Path | None = None) -> UserCode:
        import inspect

        from tuner.workloads import resolve_factory

        func = resolve_factory(ref, Path(base_dir) if base_dir else None)
        path = Path(inspect.getsourcefile(func) or "").resolve()
        return cls.of_file(path)

    @classmethod
    def of_file(cls, path: Path) -> UserCode:
        path = path.resolve()
        installed = TUNER_DIR in path.parents or any(path.is_relative_to(d) for d in LIBRARY_DIRS)
        return cls(roots=() if installed else (str(path.parent),), files=frozenset({str(path)}))

    def seen_files(self) -> list[str]:
        """The workload's own files: its file, and those whose lines the check saw run."""
        return sorted(self.files | {os.path.realpath(f) for f, own in self._seen.items() if own})

    def owns(self, filename: str) -> bool:
        known = self._seen.get(filename)
        if known is None:
            path = os.path.realpath(filename)
            known = path in self.files or (
                any(path.startswith(r + os.sep) for r in self.roots)
                and not path.startswith(str(TUNER_DIR) + os.sep)
                and "site-packages" not in path and "dist-packages" not in path)
            self._seen[filename] = known
        return known


def _owner(filename: str) -> str:
    """``torch``, ``tuner``, a library's top-level package, or ``?``."""
    path = os.path.realpath(filename)
    if path.startswith(str(TORCH_DIR) + os.sep):
        return "torch"
    if path.startswith(str(TUNER_DIR) + os.sep):
        return "tuner"
    for d in LIBRARY_DIRS:
        if path.startswith(d + os.sep):
            return Path(path).relative_to(d).parts[0].removesuffix(".py")
    return "?"


class Sites:
    """Where calls come from: the innermost caller that is not torch's own code, the
    user's (a finding), the tuner's (never the user's) or a library's (summarized)."""

    def __init__(self, user: UserCode):
        self.user = user
        self.library: dict[tuple[str, str], int] = defaultdict(int)

    def caller(self, frame: FrameType | None) -> tuple[str, FrameType | None, str | None, bool]:
        """``("user", frame, via, in_module)``, ``("tuner", None, None, False)``,
        ``(package, None, None, False)``; ``via``: the innermost torch function between the
        user's line and the call; ``in_module``: the call is inside one of torch's own
        modules that the user's line called (``nn.GRU`` building its zero initial state)."""
        via, in_module = None, False
        while frame is not None:
            name = frame.f_code.co_filename
            if self.user.owns(name):
                return "user", frame, via, in_module
            owner = _owner(name)
            if owner == "tuner" and frame.f_code.co_filename == __file__:
                frame = frame.f_back  # this check's own handlers
                continue
            if owner != "torch":
                return owner, None, None, False
            module = frame.f_globals.get("__name__", "torch")
            if via is None and not module.startswith(("torch.overrides", "torch._tensor")):
                via = f"{module}.{frame.f_code.co_name}"
            in_module = in_module or (module == "torch.nn.modules.module" and frame.f_code.co_name in _MODULE_CALL)
            frame = frame.f_back
        return "?", None, None, False


def where(frame: FrameType) -> tuple[str, str]:
    """``file:line`` and the function (a comprehension's with the function around it)."""
    name = frame.f_code.co_name
    if name.startswith("<") and frame.f_back is not None:
        name = f"{name} in {frame.f_back.f_code.co_name}"
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno}", name


def _short(filename: str) -> str:
    """Relative to the working folder where it is inside it, else absolute."""
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel


# ---- pass 1: the torch calls of the user's lines ---------------------------------------


@dataclass
class _Site:
    kind: str
    what: str
    function: str
    calls: int = 0
    seconds: float = 0.0
    signatures: set = field(default_factory=set)
    filled: bool = False  # an invariant's tensor written in place after: a buffer, not a constant


def _signature(args: tuple, kwargs: dict) -> tuple | None:
    """The arguments of a tensor factory as a hashable key; None when a tensor is among
    them (the result then depends on data, not constants)."""
    def key(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            raise TypeError
        if isinstance(v, list | tuple):
            return tuple(key(x) for x in v)
        if isinstance(v, dict):
            return tuple(sorted((k, key(x)) for k, x in v.items()))
        return v if isinstance(v, int | float | bool | str | type(None)) else repr(v)
    try:
        return key(args), key(kwargs)
    except TypeError:
        return None


def _copy_target(name: str, args: tuple, kwargs: dict) -> tuple[torch.device | None, bool]:
    """Where ``tensor.to(...)``/``.cuda(...)``/``dst.copy_(src)`` copies to, and whether
    it is non-blocking."""
    non_blocking = bool(kwargs.get("non_blocking", False))
    if name == "cuda":
        return torch.device("cuda"), non_blocking or (len(args) > 2 and bool(args[2]))
    if name == "copy_":
        dst = args[0]
        return dst.device, non_blocking or (len(args) > 2 and bool(args[2]))
    device = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, torch.Tensor):
            device = a.device
        elif isinstance(a, torch.device | str | int) and not isinstance(a, bool):
            device = a
        elif isinstance(a, bool):
            non_blocking = non_blocking or a
            break
    return (torch.device(device) if device is not None else None), non_blocking


class _Calls(TorchFunctionMode):
    """Every torch call made directly from the user's lines, by site."""

    def __init__(self, sites: Sites, on_gpu: bool):
        super().__init__()
        self.sites, self.on_gpu = sites, on_gpu
        self.found: dict[tuple[str, str, str], _Site] = {}
        # the tensors the user's factory calls built, by id (a weak reference tells that the
        # id is still that tensor's), and their views: one written in place is a buffer
        # filled each step (a padded batch in a collate), not a constant rebuilt
        self.built: dict[int, tuple[weakref.ref, _Site]] = {}
        self.anomaly = False  # autograd's anomaly detection on during the step

    def _track(self, out: Any, site: _Site) -> None:
        if isinstance(out, torch.Tensor):
            if len(self.built) > 4096:  # the dead ones go
                self.built = {k: v for k, v in self.built.items() if v[0]() is not None}
            self.built[id(out)] = (weakref.ref(out), site)

    def _site_of(self, value: Any) -> _Site | None:
        entry = self.built.get(id(value)) if isinstance(value, torch.Tensor) else None
        return entry[1] if entry and entry[0]() is value else None

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.anomaly = self.anomaly or torch.is_anomaly_enabled()  # turned on inside the step, too
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        viewed = None
        if self.built and args:
            if (site := self._site_of(args[0])) is not None:
                if name == "__setitem__" or (name.endswith("_") and not name.endswith("__")):
                    site.filled = True
                elif name in _VIEWS:
                    viewed = site
        out = self._dispatch(func, name, args, kwargs, sys._getframe(1))
        if viewed is not None:
            self._track(out, viewed)
        return out

    def _dispatch(self, func: Callable, name: str, args: tuple, kwargs: dict, caller: FrameType) -> Any:
        kind = self._kind(name, args, kwargs)
        if kind is None:
            return func(*args, **kwargs)
        owner, frame, via, in_module = self.sites.caller(caller)
        if owner != "user":
            if owner != "tuner":
                self.sites.library[(owner, kind[1])] += 1
            return func(*args, **kwargs)
        if kind[0] == "invariant" and in_module:
            return func(*args, **kwargs)  # torch's module builds it: no line of the user's to move
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - t0
        if kind[0] == "invariant" and (not isinstance(out, torch.Tensor) or out.numel() < INVARIANT_NUMEL):
            return out
        loc, function = where(frame)
        what = kind[1] if via is None else f"{kind[1]} inside {via}"
        site = self.found.setdefault((loc, kind[0], what), _Site(kind[0], what, function))
        site.calls += 1
        site.seconds += seconds
        if kind[0] == "invariant":
            site.signatures.add(_signature(args, kwargs))
            self._track(out, site)
        return out

    def _kind(self, name: str, args: tuple, kwargs: dict) -> tuple[str, str] | None:
        if name in SYNCS:
            return SYNCS[name]
        if name == "where" and len(args) == 1 and not kwargs:
            return "dynamic_size", "torch.where(condition)"
        if name == "__getitem__" and len(args) > 1 and _bool_index(args[1]):
            return "dynamic_size", "indexing with a boolean mask"
        if name in FACTORIES and _signature(args, kwargs) is not None:
            return "invariant", f"torch.{name}(...) from the same constants"
        if self.on_gpu and name in ("to", "cuda", "copy_") and args and isinstance(args[0], torch.Tensor):
            src = args[1] if name == "copy_" and len(args) > 1 else args[0]
            if not isinstance(src, torch.Tensor) or src.device.type != "cpu":
                return None
            device, non_blocking = _copy_target(name, args, kwargs)
            if device is None or device.type != "cuda":
                return None
            if not src.is_pinned():
                return "unpinned_copy", f".{name}() of pageable host memory to the GPU"
            if not non_blocking:
                return "blocking_copy", f".{name}() to the GPU without non_blocking"
        return None


def _bool_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _call_findings(calls: _Calls, steps: int, device: torch.device) -> list[Finding]:
    on_gpu = device.type == "cuda"
    out = []
    for (loc, kind, what), s in calls.found.items():
        if kind == "invariant" and (len(s.signatures) != 1 or s.calls < steps or s.filled):
            continue  # its arguments changed, it is not built every step, or it is a buffer filled
        ms = s.seconds * 1e3 / steps
        if kind in ("sync", "branch", "dynamic_size"):
            cost = (f"the host waited {ms:.3f} ms per step in it, measured on the device" if on_gpu else
                    "count only on a CPU, where no device queue is waited for; on a GPU each one "
                    "waits for all queued work")
        elif kind == "invariant":
            cost = f"{ms:.3f} ms per step of host time to build it, measured"
        else:
            cost = f"{ms:.3f} ms per step in the copy, measured"
        waits = kind in ("sync", "branch", "dynamic_size")  # on a CPU, nothing queued to wait for: a count
        out.append(Finding(kind, loc, s.function, what, s.calls / steps, None if waits and not on_gpu else ms,
                           cost, FIX["sync" if kind == "sync" else kind]))
    return out


def _anomaly_finding(user: UserCode, cost_ms: float | None) -> Finding:
    """Autograd's anomaly detection, on during the step: named at the workload's own call
    that turns it on (``set_detect_anomaly(True)`` or ``with detect_anomaly():``, found in
    its source), or said of the process where none of its files holds one. ``cost_ms``:
    the step with it on less the step with it off, None where the step turns it on itself."""
    import ast

    loc, function = "(set outside the workload's files)", "the process"
    # on for the process: a set_detect_anomaly(True) likely did it; turned on in the step: a
    # `with detect_anomaly():` (either, where only the other is there)
    first, then = ("set_detect_anomaly", "detect_anomaly")[::1 if cost_ms is not None else -1]
    for path in user.seen_files():
        try:
            tree = ast.parse(Path(path).read_text())
        except (OSError, SyntaxError, ValueError):
            continue
        found = _anomaly_call(tree, first) or _anomaly_call(tree, then)
        if found:
            loc, function = f"{_short(path)}:{found[0]}", found[1]
            break
    if cost_ms is None:
        cost = "turned on inside the step, so it cannot be timed off here; often several times the step"
    else:
        cost = f"{cost_ms:.3f} ms per step, measured against the same steps with it off"
    return Finding("anomaly", loc, function, "autograd anomaly detection on (torch.autograd.detect_anomaly)",
                   1.0, cost_ms, cost, FIX["anomaly"])


def _anomaly_call(tree: Any, called: str) -> tuple[int, str] | None:
    """(line, enclosing function) of the first call of ``called`` that turns anomaly
    detection on."""
    import ast

    def visit(node: Any, function: str) -> tuple[int, str] | None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef) else function
            if isinstance(child, ast.Call):
                name = getattr(child.func, "attr", getattr(child.func, "id", ""))
                off = child.args and isinstance(child.args[0], ast.Constant) and child.args[0].value is False
                if name == called and not off:
                    return child.lineno, function
            if (hit := visit(child, inner)) is not None:
                return hit
        return None

    return visit(tree, "<module>")


# ---- the workload's own autocast ---------------------------------------------------------


class OwnAutocast:
    """Where the workload's code turns ``torch.autocast`` on itself (a ``with`` block or a
    decorator), seen through ``sys.setprofile`` while inside: inside it the precision knob
    has no effect, so the knob's values run alike. The tuner's own autocast (the knob's)
    and an autocast turned off (an fp32 region) are not counted."""

    def __init__(self) -> None:
        self.sites: dict[tuple[str, str], list] = {}  # (file:line, function) -> [dtype, times entered]
        self._prev: Any = None

    def __enter__(self) -> OwnAutocast:
        self._prev = sys.getprofile()
        sys.setprofile(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(self._prev)

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is _AUTOCAST_ENTER:
            self.saw(frame)

    def saw(self, frame: FrameType) -> None:
        """``frame``: an autocast's ``__enter__``, just called."""
        ac = frame.f_locals.get("self")
        if not getattr(ac, "_enabled", False):  # off, or not available on its device (it warned)
            return
        site = _autocast_site(frame.f_back)
        if site is not None:
            self.sites.setdefault(site, [str(ac.fast_dtype).removeprefix("torch."), 0])[1] += 1

    def described(self) -> list[str]:
        """``file:line (dtype, in function)``, one per place."""
        return [f"{loc} ({dtype}, in {function})" for (loc, function), (dtype, _) in self.sites.items()]

    def findings(self, steps: int) -> list[Finding]:
        return [Finding("autocast", loc, function, f"torch.autocast({dtype}) turned on in the step", n / steps, None,
                        "no cost of its own: inside it the precision knob has no effect, so its values run alike",
                        FIX["autocast"])
                for (loc, function), (dtype, n) in self.sites.items()]


def _autocast_site(frame: FrameType | None) -> tuple[str, str] | None:
    """Where an autocast was entered from: the function a decorator wraps, else the
    innermost caller outside torch; None where that is the tuner's own loop."""
    while frame is not None and _owner(frame.f_code.co_filename) == "torch":
        if frame.f_code.co_name == "decorate_autocast":  # @torch.autocast(...) on a function
            code = getattr(frame.f_locals.get("func"), "__code__", None)
            if code is not None:
                return (None if _owner(code.co_filename) == "tuner" else
                        (f"{_short(code.co_filename)}:{code.co_firstlineno}", code.co_name))
        frame = frame.f_back
    if frame is None or _owner(frame.f_code.co_filename) == "tuner":
        return None
    return where(frame)


# ---- pass 2: Python builtins from the user's lines -------------------------------------


class _Builtins:
    """``sys.setprofile``: the builtins the guides name (``BUILTINS``) and the functions a
    step should not call (``CALLS``), called from the user's lines."""

    def __init__(self, user: UserCode):
        self.user = user
        self.counts: dict[tuple[str, str, str], list] = {}
        self._args: dict[tuple[Any, int], int] = {}
        self._open: list[tuple[tuple, FrameType, Any, float]] = []
        self.autocast = OwnAutocast()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":  # a Python function: its caller is the line
            if frame.f_code is _AUTOCAST_ENTER:
                self.autocast.saw(frame)
                return
            name = CALLS.get(frame.f_code)
            if name is None or frame.f_back is None or not self.user.owns(frame.f_back.f_code.co_filename):
                return
            self._enter(name, frame.f_back, frame, None)
        elif event == "c_call":
            name = BUILTINS.get(id(arg))
            if name is None or not self.user.owns(frame.f_code.co_filename):
                return
            if name == "getattr" and self._nargs(frame) < 3:
                return  # a plain getattr(obj, name) is an attribute read
            self._enter(name, frame, frame, arg)
        elif event in ("return", "c_return", "c_exception") and self._open and self._open[-1][1] is frame \
                and self._open[-1][2] is (None if event == "return" else arg):
            key, _, _, t0 = self._open.pop()
            self.counts[key][1] += time.perf_counter() - t0

    def _enter(self, name: str, line: FrameType, frame: FrameType, arg: Any) -> None:
        """A call counted at the user's ``line``, timed until ``frame`` returns from it
        (``arg``: the builtin called, None for a Python function's own frame)."""
        loc, function = where(line)
        key = (loc, name, function)
        self.counts.setdefault(key, [0, 0.0])[0] += 1
        self._open.append((key, frame, arg, time.perf_counter()))

    def _nargs(self, frame: FrameType) -> int:
        key = (frame.f_code, frame.f_lasti)
        n = self._args.get(key)
        if n is None:
            ins = next((i for i in dis.get_instructions(frame.f_code) if i.offset == frame.f_lasti), None)
            n = self._args[key] = ins.arg if ins is not None and ins.opname == "CALL" and ins.arg is not None else 3
        return n

    def findings(self, steps: int) -> list[Finding]:
        out = []
        for (loc, name, function), (n, seconds) in self.counts.items():
            what = WHAT.get(name, f"{name}()")
            ms = seconds * 1e3 / steps
            out.append(Finding(name, loc, function, what, n / steps, ms,
                               f"{ms:.3f} ms per step in the calls, measured under a profiling hook "
                               f"(an upper bound)", FIX[name]))
        return out


# ---- pass 3: graph breaks and recompiles -----------------------------------------------

_RECOMPILE = re.compile(r"Recompiling function (\S+) in (.+):(\d+)\n(.*)", re.S)


_BREAK = re.compile(r"in user code at (.+):(\d+)\nGraph Break Reason: (.*)", re.S)


class _CompileWatch(logging.Handler):
    """Dynamo's recompile messages (its ``recompiles`` log), its recompile-limit warnings
    and its graph breaks' full reasons (its ``graph_breaks`` log: where a break it cannot
    resume from leaves its list of reasons a bare code such as ``step_unsupported``),
    kept here and not printed."""

    LOGGERS = ("torch._dynamo.guards.__recompiles", "torch._dynamo.symbolic_convert.__graph_breaks",
               "torch._dynamo.convert_frame")
    QUIET = 2  # the first LOGGERS print nothing of their own while watched

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.recompiles: list[str] = []
        self.limit: list[str] = []
        self.breaks: dict[tuple[str, int], str] = {}  # (file, line): the break's reason in words

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith("Recompiling function"):
            self.recompiles.append(msg)
        elif "recompile_limit" in msg or "cache_size_limit" in msg:
            self.limit.append(msg)
        elif m := _BREAK.search(msg):
            self.breaks.setdefault((os.path.realpath(m.group(1)), int(m.group(2))), _break_words(m.group(3)))

    @contextlib.contextmanager
    def watching(self) -> Iterator[_CompileWatch]:
        loggers = [logging.getLogger(n) for n in self.LOGGERS]
        saved = [(lg.propagate, lg.level) for lg in loggers]
        torch._logging.set_logs(recompiles=True, graph_breaks=True)
        for lg in loggers:
            lg.addHandler(self)
        for lg in loggers[: self.QUIET]:
            lg.propagate = False
        try:
            yield self
        finally:
            for lg, (propagate, level) in zip(loggers, saved, strict=True):
                lg.removeHandler(self)
                lg.propagate, lg.level = propagate, level
            torch._logging.set_logs()


def _break_words(reason: str) -> str:
    """A logged break's reason in one line: what dynamo met and its explanation (the
    headline after "Graph break encountered:", where the break could not be resumed)."""
    lines = [x.strip() for x in reason.split("Graph break encountered:")[-1].strip().splitlines() if x.strip()]
    head = lines[0] if lines else reason.strip()
    why = next((x.removeprefix("Explanation:").strip() for x in lines if x.startswith("Explanation:")), "")
    hint = next((x.removeprefix("Hint:").strip() for x in lines if x.startswith("Hint:")), "")
    return head + "".join(f" ({x})" for x in (why, hint) if x and x not in head)


def _break_findings(sites: Sites, reasons: list, logged: dict[tuple[str, int], str] | None = None) -> list[Finding]:
    """Graph breaks at the user's lines; ``logged``: the reasons in words by (file, line),
    for a break whose own reason is a bare code."""
    out: dict[tuple[str, str], Finding] = {}
    for r in reasons:
        frame = next((f for f in reversed(r.user_stack) if sites.user.owns(f.filename)), None)
        reason = r.reason.strip().splitlines()[0]
        if frame is not None and " " not in reason:
            reason = (logged or {}).get((os.path.realpath(frame.filename), frame.lineno), reason)
        reason = _plain_break(reason)
        if frame is None:
            owner = next((_owner(f.filename) for f in reversed(r.user_stack)), "?")
            if owner not in ("tuner", "torch"):
                sites.library[(owner, "graph break")] += 1
            continue
        loc = f"{_short(frame.filename)}:{frame.lineno}"
        out.setdefault((loc, reason), Finding(
            "graph_break", loc, frame.name, f"graph break: {reason}", None, None,
            "count only: the code around it runs as separate graphs", FIX["graph_break"]))
    return list(out.values())


def _plain_break(reason: str) -> str:
    if reason.startswith("generic_jump"):
        return f"an if or while on a tensor's value (dynamo: {reason})"
    return reason


def _plain_guard(guard: str) -> str:
    if "size mismatch" in guard:
        return f"an input's shape changed ({guard})"
    if re.search(r"==\s*-?\d+\.\d+", guard):
        return f"a Python float that changes is baked into the graph ({guard})"
    return f"the guard {guard!r} failed"


def _recompile_findings(sites: Sites, watch: _CompileWatch, settled: int, steps: int) -> list[Finding]:
    """Every recompile after the first compile is the user's to see (a clean step with
    fixed shapes has none); ``per_step`` counts those of the observed steps, after the
    ``settled`` ones of the first steps (where a changing shape is made dynamic)."""
    by: dict[tuple[str, str], list] = {}
    for i, msg in enumerate(watch.recompiles):
        m = _RECOMPILE.match(msg)
        if not m:
            continue
        func, filename, line, rest = m.groups()
        user_line = re.search(r'File "([^"]+)", line (\d+)', rest)
        if user_line and sites.user.owns(user_line.group(1)):
            filename, line = user_line.groups()
        if not sites.user.owns(filename):
            owner = _owner(filename)
            if owner not in ("tuner", "torch"):
                sites.library[(owner, "recompile")] += 1
            continue
        guard = next((ln.strip().lstrip("- ").split("#")[0].strip() for ln in rest.splitlines()
                      if re.match(r"\s*- \d+/\d+:", ln)), "a guard failed")
        guard = _plain_guard(re.sub(r"^\d+/\d+:\s*", "", guard))
        by.setdefault((f"{_short(filename)}:{line}", re.sub(r"_at_\d+$", "", func.removeprefix("torch_dynamo_resume_in_"))),
                      []).append((i >= settled, guard))
    out = [Finding("recompile", loc, func, f"recompiled {len(seen)} times, {sum(s for s, _ in seen)} of them in "
                   f"the last {steps} steps: {seen[-1][1]}", sum(s for s, _ in seen) / steps, None,
                   "count only: each recompile costs a compile", FIX["recompile"])
           for (loc, func), seen in by.items()]
    if watch.limit:
        out.append(Finding("recompile", "?", "?", "dynamo hit its recompile limit and runs the function eagerly "
                           "from then on", None, None, "count only", FIX["recompile"]))
    return out


# ---- the check --------------------------------------------------------------------------


def _eager(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "_orig_mod", model)


def _batches(trainer: Any, n: int) -> list:
    it = iter(trainer.loader)
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def _sample_groups(trainer: Any, n: int) -> list[list]:
    """``n`` batches' worth of the dataset's items, not yet collated."""
    import itertools

    bs = trainer.config["micro_batch_size"]
    ds = trainer.dataset
    if hasattr(ds, "__getitem__") and hasattr(ds, "__len__"):
        items = [ds[i] for i in range(min(n * bs, len(ds)))]
    else:
        items = list(itertools.islice(iter(ds), n * bs))
    return [items[i:i + bs] for i in range(0, len(items) - bs + 1, bs)]


def _feed(trainer: Any, user: UserCode, n: int) -> Callable[[], None]:
    """Batches in memory for the check's steps, and a function that starts them over.
    The workload's own ``collate`` is per-batch work of its own: it then runs in the
    observed steps, on items read beforehand."""
    import inspect
    import itertools

    collate = trainer.workload.collate
    source = inspect.getsourcefile(collate) if collate is not None and inspect.isfunction(collate) else None
    if source and user.owns(source):
        groups = _sample_groups(trainer, n)
        if not groups:
            raise ValueError("the dataset yields no batch")

        def restart() -> None:
            trainer._it = (collate(g) for g in itertools.cycle(groups))
        return restart
    batches = _batches(trainer, n)
    if not batches:
        raise ValueError("the dataset yields no batch")
    return lambda: trainer.feed(batches)


def check(trainer: Any, user: UserCode, steps: int = 5, warm: int = 3) -> dict:
    """Run the hot-path check on ``trainer`` (any state: it is fed batches of its own
    loader, in memory); returns ``{"findings": [...], "library": [...], ...}``.

    Each pass runs ``warm`` unobserved steps first (lazy initialization, the first
    compile), then ``steps`` observed ones; counts are per optimizer step.
    """
    from tuner.loop import synchronize

    t_start = time.perf_counter()
    device = trainer.device
    sites = Sites(user)
    restart = _feed(trainer, user, (warm + steps) * trainer.accum)
    compiled = trainer.model
    findings: list[Finding] = []
    notes = []

    def run(n: int) -> None:
        restart()
        for _ in range(n):
            trainer.step()
        synchronize(device)

    if trainer.config["compile"] != "off":
        import torch._dynamo.utils as dynamo_utils

        # compiled anew under watch (a reset clears dynamo's caches and its list of
        # graph breaks): everything this process compiled before is not seen twice
        torch._dynamo.reset()
        watch = _CompileWatch()
        with watch.watching():
            run(warm)
            settled = len(watch.recompiles)
            run(steps)
        findings += _break_findings(sites, list(dynamo_utils.graph_break_reasons), watch.breaks)
        findings += _recompile_findings(sites, watch, settled, steps)
    trainer.model = _eager(compiled)
    try:
        t = time.perf_counter()
        run(warm)  # unobserved: its time is the eager step that each finding's cost is a share of
        step_ms = (time.perf_counter() - t) * 1e3 / warm
        anomaly_ms = None
        if torch.is_anomaly_enabled():  # on for the whole process: the same steps timed with it off
            with torch.autograd.set_detect_anomaly(False):
                t = time.perf_counter()
                run(warm)
                anomaly_ms = max(0.0, step_ms - (time.perf_counter() - t) * 1e3 / warm)
        calls = _Calls(sites, device.type == "cuda")
        with calls:
            run(steps)
        findings += _call_findings(calls, steps, device)
        if calls.anomaly:
            findings.append(_anomaly_finding(user, anomaly_ms))
        hook = _Builtins(user)
        sys.setprofile(hook)
        try:
            run(steps)
        finally:
            sys.setprofile(None)
        findings += hook.findings(steps) + hook.autocast.findings(steps)
    finally:
        trainer.model = compiled
    if device.type != "cuda":
        notes.append("host-to-device copies are checked on a GPU only")
    if trainer.config["compile"] == "off":
        notes.append("graph breaks and recompiles are checked with compile on")
    order = {k: i for i, k in enumerate(FIX)}
    findings.sort(key=lambda f: (order.get(f.kind, 99), f.where))
    return {
        "findings": [asdict(f) for f in findings],
        "library": [{"package": p, "what": what, "per_step": n / steps}
                    for (p, what), n in sorted(sites.library.items())],
        "steps": steps, "step_ms": step_ms, "device": str(device), "compile": trainer.config["compile"],
        "user_code": list(user.roots) or sorted(user.files), "notes": notes,
        "check_s": time.perf_counter() - t_start,
    }
