"""Whether the code a call of a user's function runs may make a
``torch.Generator`` (NOTE [the code a call runs makes a generator])."""

from __future__ import annotations

import dis
import functools
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .module_hooks import user_hooks
from .references import reachable, users_code

# NOTE [the code a call runs makes a generator]
# A derivative call of a function that may make a generator in the call runs
# under a dispatch mode that notes its draws (NOTE [generators a function
# makes] in random_state.py): a Python call on every op, 1.5-1.9x the time of
# a jitted ``jax.grad`` of a small dropout MLP in graph mode. Deciding that by
# whether the function's code, or any method of a class it reaches or runs
# as a module, names ``Generator`` put every module whose class merely
# mentions it (``reset_parameters(self, generator=None)`` making one when
# given none, never called in the step) under that mode. So the search
# (``makes_generators``, once per signature) looks only at the code a call
# can run, and only for a call of ``torch.Generator``:
#
# - the code: the function and the user's code it reaches
#   (``references.reachable``: what it names in its closure, globals and
#   default arguments, a bound method's object, a ``functools.partial``'s
#   function); of a module it runs (``modules``, with their submodules),
#   ``forward``, its dunder methods but ``__init__`` and ``__new__`` (they
#   ran when it was built), and the hooks of those modules and the global
#   ones; of a class that code names (it may build one in the call), its
#   ``forward`` and dunder methods; and of any of those classes, each method
#   whose name that code names (``self._mask(x)``, ``super().reset()``),
#   until no new one is named. A method that no code named (the unused
#   ``reset_parameters``), PyTorch's and other libraries' code, and the
#   function's own signature (a method's annotations and default arguments
#   are its class body's code, not its own) are not looked at. A method
#   reached only by a name made at run time (``getattr(self, name)()``) is
#   not found.
# - a call: each place the code loads ``Generator`` (``torch.Generator``,
#   ``from torch import Generator``, or a closure variable bound to it)
#   counts, unless the loaded value is provably not called
#   (``_only_checked``): the second argument of ``isinstance`` or
#   ``issubclass``, an operand of ``is`` or ``==``, or a nested function's
#   annotation (``torch.Generator | None``), followed along the bytecode in
#   straight-line code from the load. Anything else (stored, returned,
#   passed on, a jump in between, an instruction not known here) counts, as
#   does ``torch.Generator`` held under another name (``G =
#   torch.Generator``) or where no code's name loads it (a default
#   argument, a ``functools.partial``, a dict entry).
#
# A generator a module made when it was built (``self.gen =
# torch.Generator()`` in ``__init__``) is no generator the call makes: it is
# the module's, watched with the generators the function's code names
# (``referenced_generators`` in random_state.py).


def makes_generators(fn: Callable[..., Any], modules: Sequence[torch.nn.Module]) -> bool:
    """Whether the code a call of ``fn`` runs (``fn``, the user's code it
    reaches, and of the ``modules`` it runs their ``forward``, the methods it
    names and their hooks) may call ``torch.Generator``: it may make
    generators of its own (NOTE [the code a call runs makes a generator])."""
    search = _GeneratorCallSearch()
    search.code_of(fn)
    run = [sub for module in modules for sub in module.modules()]
    for hook in user_hooks(run):
        search.code_of(hook)
    for klass in {type(sub) for sub in run}:
        search.note_class(klass, built=False)
    return search.finish()


# The dunder methods a call does not run of a module that was built before it.
_BUILDING = frozenset({"__init__", "__new__", "__init_subclass__", "__set_name__", "__class_getitem__"})


class _GeneratorCallSearch:
    """The search of ``makes_generators``: the user's code met so far, the
    names it loads (a method named there may run), and the classes met,
    with the methods of theirs looked at."""

    def __init__(self) -> None:
        self.found = False
        self._names: set[str] = set()
        self._code_seen: set[int] = set()
        self._classes: dict[type, bool] = {}  # whether the call may build one
        self._methods_seen: set[tuple[type, str]] = set()

    def code_of(self, obj: Any) -> None:
        """Look at ``obj`` and the user's code it reaches."""
        bindings: list[tuple[Any, Any, Any]] = []
        reachable(obj, self._look_at, bindings=bindings)
        if any(value is torch.Generator and not _loaded_as_generator(holder, key) for holder, key, value in bindings):
            self.found = True  # held where no load of its name shows how it is used

    def note_class(self, klass: type, built: bool) -> None:
        """A class of the user's whose methods the call may run; ``built``:
        it may build one too."""
        self._classes[klass] = self._classes.get(klass, False) or built

    def finish(self) -> bool:
        """Look at the methods of the classes met that may run, until none is
        new; whether a call of ``torch.Generator`` was found."""
        while not self.found:
            methods = [
                (owner, name, member)
                for klass, built in list(self._classes.items())
                for owner in klass.__mro__
                if users_code(owner.__module__)
                for name, member in vars(owner).items()
                if (owner, name) not in self._methods_seen and self._may_run(name, built)
            ]
            if not methods:
                break
            for owner, name, member in methods:
                self._methods_seen.add((owner, name))
                for runs in _run_by(member):
                    self.code_of(runs)
        return self.found

    def _may_run(self, name: str, built: bool) -> bool:
        if name in self._names or name == "forward":
            return True
        dunder = name.startswith("__") and name.endswith("__")
        return dunder and (built or name not in _BUILDING)

    def _look_at(self, obj: Any) -> bool:
        """``references.reachable``'s test: notes each function of the
        user's (its code, what it names) and each class of the user's met;
        never stops the walk."""
        if isinstance(obj, type):
            if users_code(obj.__module__):
                self.note_class(obj, built=True)
            return False
        if isinstance(obj, functools.partial) and torch.Generator in (obj.func, *obj.args, *obj.keywords.values()):
            self.found = True
            return False
        function = getattr(obj, "__func__", obj)
        code = getattr(function, "__code__", None)
        if not isinstance(code, types.CodeType) or not users_code(getattr(function, "__module__", None)):
            return False
        if any(value is torch.Generator for value in _defaults(function)):
            self.found = True
        if id(code) not in self._code_seen:
            self._code_seen.add(id(code))
            aliases = {"Generator", *_closure_names_of_generator(function)}
            for nested in _code_in(code):
                self._names.update(nested.co_names)
                if not self.found and _calls_generator(nested, aliases):
                    self.found = True
        return False


def _run_by(member: Any) -> list[Any]:
    """What a class attribute runs: a function, a static or class method's
    function, a property's getter, setter and deleter, a nested class."""
    if isinstance(member, property):
        return [f for f in (member.fget, member.fset, member.fdel) if f is not None]
    if isinstance(member, (staticmethod, classmethod)):
        return [member.__func__]
    return [member] if isinstance(member, (types.FunctionType, type)) else []


def _defaults(function: Any) -> list[Any]:
    """A function's default argument values."""
    keywords = getattr(function, "__kwdefaults__", None) or {}
    return [*(getattr(function, "__defaults__", None) or ()), *keywords.values()]


def _closure_names_of_generator(function: Any) -> list[str]:
    """The closure variables of ``function`` that hold ``torch.Generator``."""
    names = []
    for name, cell in zip(function.__code__.co_freevars, getattr(function, "__closure__", None) or ()):
        try:
            if cell.cell_contents is torch.Generator:
                names.append(name)
        except ValueError:  # an empty cell
            pass
    return names


def _loaded_as_generator(holder: Any, key: Any) -> bool:
    """Whether ``torch.Generator``, found held by ``holder`` under ``key``
    (``references.reachable``'s bindings), is used only through loads that
    ``_calls_generator`` looks at: a closure cell's, or a module's global
    named ``Generator`` (``from torch import Generator``). Under another
    name (``G = torch.Generator``), in a dict or a list, it counts."""
    if isinstance(holder, types.CellType):
        return True
    return key == "Generator" and isinstance(holder, dict) and "__builtins__" in holder


def _code_in(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and the code defined in it (a nested function, a lambda, a
    comprehension, a class body)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_in(const)


def _calls_generator(code: types.CodeType, aliases: set[str]) -> bool:
    """Whether ``code`` loads a name in ``aliases`` (``Generator``, or a
    name bound to it) other than where it is provably not called."""
    if aliases.isdisjoint((*code.co_names, *code.co_varnames, *code.co_freevars, *code.co_cellvars)):
        return False
    instructions = list(dis.get_instructions(code))
    return any(
        ins.opname.startswith("LOAD_") and ins.argval in aliases and not _only_checked(instructions, i)
        for i, ins in enumerate(instructions)
    )


# Instructions that pop nothing: what they push counts from their stack effect.
_POP_NOTHING = frozenset(
    {"LOAD_CONST", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_GLOBAL", "LOAD_NAME"}
    | {"LOAD_CLOSURE", "PUSH_NULL", "KW_NAMES", "NOP", "CACHE", "EXTENDED_ARG", "RESUME", "LOAD_SMALL_INT"}
)
# Instructions that combine what they pop into one value, which is followed on.
_COMBINING = {
    "BINARY_OP": lambda arg: 2,
    "BINARY_SUBSCR": lambda arg: 2,
    "BUILD_TUPLE": lambda arg: arg,
    "BUILD_LIST": lambda arg: arg,
    "BUILD_MAP": lambda arg: 2 * arg,
    "BUILD_CONST_KEY_MAP": lambda arg: arg + 1,
}
_COMPARING = frozenset({"COMPARE_OP", "IS_OP"})
_POPS_ONE = frozenset({"LOAD_ATTR", "LOAD_METHOD"})  # and push one or two
_CALLS = frozenset({"PRECALL", "CALL", "CALL_KW"})
_CHECKS = frozenset({"isinstance", "issubclass"})
_ANNOTATIONS = 0x04  # MAKE_FUNCTION's and SET_FUNCTION_ATTRIBUTE's flag for annotations


def _only_checked(instructions: Sequence[dis.Instruction], at: int) -> bool:
    """Whether the value loaded by ``instructions[at]`` (or what it is
    combined into: ``torch.Generator | None``) is provably not called: it is
    the argument of ``isinstance`` or ``issubclass``, an operand of a
    comparison, or a nested function's annotations; False wherever that is
    not sure (NOTE [the code a call runs makes a generator])."""
    above = 0  # stack entries above the value followed
    combined = False  # the value followed holds it, combined with others
    for i in range(at + 1, len(instructions)):
        ins = instructions[i]
        effect = _stack_effect(ins)
        if effect is None or ins.is_jump_target:
            return False
        name, arg = ins.opname, ins.arg or 0
        if name in _CALLS:  # the first of PRECALL and CALL, on Python 3.11
            count = arg + (name == "CALL_KW")  # the keyword names' tuple is on top
            if above >= count:  # called, or below the call's callable: not sure
                return False
            return not combined and _callee_loads(instructions, i, count) in _CHECKS
        if name in _POP_NOTHING:
            above += effect
        elif name in _COMBINING:
            pops = _COMBINING[name](arg)
            if above < pops:
                above, combined = 0, True
            else:
                above += effect
        elif name in _COMPARING:
            if above < 2:
                return True  # compared, a bool
            above += effect
        elif name in _POPS_ONE:
            if above == 0:
                return False
            above += effect
        elif name in ("MAKE_FUNCTION", "SET_FUNCTION_ATTRIBUTE"):
            return combined and _is_annotations(name, arg, above)
        else:
            return False
    return False


def _is_annotations(name: str, flags: int, above: int) -> bool:
    """Whether the entry ``above`` entries below the top of the stack, at a
    ``MAKE_FUNCTION`` (or ``SET_FUNCTION_ATTRIBUTE``) with ``flags``, is the
    function's annotations."""
    if name == "SET_FUNCTION_ATTRIBUTE":  # the attribute, then the function on top
        return flags == _ANNOTATIONS and above == 1
    if not flags & _ANNOTATIONS:
        return False
    return above == 1 + bool(flags & 0x08)  # the code on top, the closure below it


def _callee_loads(instructions: Sequence[dis.Instruction], call: int, args: int) -> Any:
    """What the instruction that put the callable of the call at ``call``
    (with ``args`` entries above it) loaded, if it is a load; None where
    that is not sure."""
    depth = 0  # relative to the stack at the call
    for i in range(call - 1, -1, -1):
        ins = instructions[i]
        effect = _stack_effect(ins)
        if effect is None:
            return None
        before = depth - effect
        if before <= -(args + 1):
            return ins.argval if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") else None
        if ins.is_jump_target:
            return None
        depth = before
    return None


def _stack_effect(ins: dis.Instruction) -> int | None:
    """How many entries ``ins`` adds to the stack (net); None for a jump
    (straight-line code only) or an instruction ``dis`` cannot say."""
    if ins.opcode in dis.hasjrel or ins.opcode in dis.hasjabs:
        return None
    try:
        return dis.stack_effect(ins.opcode, ins.arg if ins.opcode >= dis.HAVE_ARGUMENT else None)
    except ValueError:
        return None
