"""A stand-in for `torchvision`, for SGLang's CPU engine (`tandem.engines.sglang_cpu` puts its
folder first on sys.path when the real package is absent or does not import: PyPI's torchvision is
built against a CUDA torch and fails on a CPU one).

SGLang imports torchvision at module level in the processors of vision models, which a text model
never calls. Here any submodule imports (`torchvision.transforms.v2.functional`), any attribute at
any depth exists (`InterpolationMode.BICUBIC`), and only using one fails: calling it, or making an
instance of a class derived from it, raises ImportError naming what was used.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any, NoReturn

__version__ = "0.0.0+tandem.standin"
TANDEM_STANDIN = True


def _fail(name: str) -> NoReturn:
    raise ImportError(f"{name}: torchvision is not installed (this is tandem's stand-in for "
                      "SGLang's CPU engine, which serves text models only)")


class Missing:
    """Any attribute of the stand-in: more of the same; calling it fails."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Missing:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        _fail(self._name)

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        name = self._name

        class Base:  # `class X(torchvision.Something)`: defined, fails when instantiated
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                _fail(name)

        Base.__qualname__ = Base.__name__ = name.rsplit(".", 1)[-1]
        return (Base,)

    def __repr__(self) -> str:
        return f"<tandem stand-in {self._name}>"


def _module_getattr(prefix: str) -> Any:
    def __getattr__(attr: str) -> Missing:  # PEP 562: a module's missing attribute
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{prefix}.{attr}")

    return __getattr__


class _Submodules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every `torchvision.X...` import: an empty package module of the stand-in."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []
        setattr(module, "__getattr__", _module_getattr(spec.name))
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


__getattr__ = _module_getattr(__name__)
if not any(isinstance(f, _Submodules) for f in sys.meta_path):
    sys.meta_path.insert(0, _Submodules())
