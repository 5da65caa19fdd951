"""Where a mixprec warning points (src/mixprec/messages/location.py): the first frame outside mixprec, torch and
contextlib, however many of their frames lie between the warning and the user's line.

The "library" frames here are functions compiled under a file name inside the mixprec package, so each test
controls exactly how deep the warning is raised and what lies between.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import torch
from torch import nn

import mixprec
from mixprec.messages.location import user_stacklevel

_LIBRARY = os.path.join(os.path.dirname(os.path.abspath(mixprec.__file__)), "_a_module_of_the_library.py")
_SOURCE = '''
import warnings

def warn_here(stacklevel):
    warnings.warn("deep", UserWarning, stacklevel=stacklevel())

def two_deep(stacklevel):
    warn_here(stacklevel)

class Hooked(nn.Module):
    def forward(self, x):
        return x

def hooked():
    module = Hooked()
    module.register_forward_pre_hook(lambda m, args: two_deep(user_stacklevel))
    return module

@contextlib.contextmanager
def warns_on_exit():
    yield
    two_deep(user_stacklevel)
'''
_library = {"nn": nn, "contextlib": contextlib, "user_stacklevel": user_stacklevel}
exec(compile(_SOURCE, _LIBRARY, "exec"), _library)


def _caught(call) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return caught


def _next_line() -> int:
    return sys._getframe(1).f_lineno + 1


def test_a_warning_two_library_frames_deep_lands_on_the_callers_line():
    line = _next_line()
    caught = _caught(lambda: _library["two_deep"](user_stacklevel))
    assert [(w.filename, w.lineno, str(w.message)) for w in caught] == [(__file__, line, "deep")]
    fixed = _caught(lambda: _library["two_deep"](lambda: 2))   # a fixed level stops inside the library
    assert fixed[0].filename == _LIBRARY


def test_torch_frames_between_are_skipped_too():
    module = _library["hooked"]()
    line = _next_line()
    caught = _caught(lambda: module(torch.ones(1)))   # nn.Module.__call__ runs the hook
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]


def test_a_context_manager_of_the_library_points_at_the_with():
    def exit_warns() -> None:
        with _library["warns_on_exit"]():   # contextlib's __exit__ runs the library's generator
            pass

    caught = _caught(exit_warns)
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, exit_warns.__code__.co_firstlineno + 1)]
