"""One root for llmgw's errors (llmgw.contracts.errors): every exception class llmgw defines
descends from LlmgwError and says what kind of trouble it is."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import llmgw
from llmgw.contracts.errors import Category, LlmgwError
from llmgw.contracts.refusals import ErrorKind, ServiceError
from llmgw.admin.client import AdminError
from llmgw.router import errors as router_errors


def _exception_classes() -> list[type]:
    found = []
    for info in pkgutil.walk_packages(llmgw.__path__, "llmgw."):
        if info.name.startswith("llmgw.remote"):
            continue  # the helper runs on nodes, standard library only
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == info.name \
                    and not name.startswith("_"):
                found.append(value)
    return found


def test_every_error_llmgw_defines_has_the_one_root():
    classes = _exception_classes()
    assert len(classes) > 50  # the walk found the families (router, fleet, config …)
    assert sorted(f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, LlmgwError)) == []


def test_each_family_says_what_kind_of_trouble_it_is():
    for cls in _exception_classes():
        if isinstance(inspect.getattr_static(cls, "category"), property):
            continue  # by the instance (below)
        assert isinstance(cls.category, Category), cls
    assert router_errors.BadRequest("x").category is Category.INPUT
    assert router_errors.ModelLoading("x").category is Category.CAPACITY
    assert router_errors.UpstreamTimeout("x").category is Category.UPSTREAM
    assert {kind: ServiceError(kind, "x").category for kind in ErrorKind} == {
        ErrorKind.INVALID: Category.INPUT, ErrorKind.NOT_FOUND: Category.NOT_FOUND,
        ErrorKind.CONFLICT: Category.CONFLICT, ErrorKind.NODE_FAILED: Category.NODE}
    assert AdminError("x", 409).category is Category.CONFLICT and AdminError("x").category is Category.INTERNAL


def test_errors_that_were_value_errors_still_are():
    from llmgw.contracts.feed import FeedError
    from llmgw.keys import KeyRefused
    assert issubclass(FeedError, ValueError) and issubclass(KeyRefused, ValueError)
