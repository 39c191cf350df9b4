"""Config: the C++ KVCacheConfig with the same field names, defaults and validation.

Fields are not duplicated here: names, text values and parsing come from the library
(KVCacheConfig::fields/set), so a field added in C++ is available from Python at once.
"""
from __future__ import annotations

from . import _kvslim


def methods() -> list[str]:
    """Method ids, in the order of the library's method registry (kvslim/methods.h)."""
    return list(_kvslim.methods())


def method_info(name: str) -> dict:
    """The registry's row of a method: name, summary, kind ("dense", "eviction", "quantizer"),
    budget_field / sink_field (None unless it evicts), h2o_core, cuda, its own config fields and
    its `kvslim eval` variants (dicts: name, description, settings "field=value,...",
    compares_to, quick, composed, recent_window_fraction, reconstruction_weight).
    An unknown name raises ConfigError naming the known ones."""
    return dict(_kvslim.method_info(name))


def variants() -> list[str]:
    """The registry's eval variants (kivi4, squeeze_s1, h2o+kivi3_g64, ...), in `kvslim eval`'s
    order; Config.from_spec(name) is one's config."""
    return list(_kvslim.variants())


def storages() -> list[str]:
    """Storage kinds an eviction method's rows may be held in (Config.storage)."""
    return list(_kvslim.storages())


def _probe_types() -> dict[str, type]:
    # The library parses text by the field's C++ type; which texts a field accepts tells its type.
    types: dict[str, type] = {}
    for name, _ in _kvslim.Config().fields():
        def accepts(text: str) -> bool:
            try:
                _kvslim.Config().set(name, text)
                return True
            except _kvslim.ConfigError:
                return False
        if accepts("not-a-number"):
            types[name] = str
        elif accepts("true"):
            types[name] = bool
        elif accepts("none"):
            types[name] = type(None)  # optional int
        elif accepts("0.5"):
            types[name] = float
        else:
            types[name] = int
    return types


_TYPES = _probe_types()


def _to_text(name: str, value) -> str:
    kind = _TYPES[name]
    if value is None:
        return "none"  # only optional fields accept it; the library names the field otherwise
    if isinstance(value, bool):
        return "true" if value else "false"
    if kind is bool and isinstance(value, int):
        raise ConfigError(f'{name}: must be true or false, got {value!r}')
    if kind is float and isinstance(value, (int, float)):
        return repr(float(value))
    if kind in (int, type(None)) and isinstance(value, float):
        raise ConfigError(f"{name}: must be an integer, got {value!r}")
    return str(value)


def _from_text(name: str, text: str):
    kind = _TYPES[name]
    if kind is bool:
        return text == "true"
    if kind is type(None):
        return None if text == "none" else int(text)
    return kind(text)


ConfigError = _kvslim.ConfigError


class Config:
    """KVCacheConfig. Config(method="squeeze", squeeze_budget=128, ...); every field is an attribute.

    Construction validates (ConfigError, a ValueError, names the field); later assignments are
    checked for type at once and for range when caches are built (or by validate()).
    """

    __slots__ = ("_c",)

    def __init__(self, method: str = "full", **fields):
        object.__setattr__(self, "_c", _kvslim.Config())
        self._set("method", method)
        for name, value in fields.items():
            self._set(name, value)
        self._c.validate()

    def _set(self, name: str, value) -> None:
        if name not in _TYPES:
            self._c.set(name, "")  # the library's error lists every field
        self._c.set(name, _to_text(name, value))

    def __getattr__(self, name: str):
        if name.startswith("_") or name not in _TYPES:
            raise AttributeError(f"Config has no field {name!r}")
        return _from_text(name, dict(self._c.fields())[name])

    def __setattr__(self, name: str, value) -> None:
        self._set(name, value)

    def validate(self) -> None:
        self._c.validate()

    def fields(self) -> dict:
        """Every field with its current value, in the library's declaration order."""
        return {name: _from_text(name, text) for name, text in self._c.fields()}

    @classmethod
    def from_spec(cls, spec: str) -> "Config":
        """The config a method spec names (kvslim/methods.h): a method or a registry eval variant
        ("kivi4", "squeeze_s1"), optionally with "@field=value,..."; raises ConfigError on an
        unknown name, a bad field or a variant only kvslim eval can run."""
        out = cls.__new__(cls)
        object.__setattr__(out, "_c", _kvslim.config_from_spec(spec))
        return out

    def copy(self) -> "Config":
        out = Config.__new__(Config)
        object.__setattr__(out, "_c", self._c.copy())
        return out

    def __repr__(self) -> str:
        default = _kvslim.Config().fields()
        changed = [f"{n}={_from_text(n, t)!r}" for (n, t), (_, d) in zip(self._c.fields(), default) if t != d or n == "method"]
        return f"kvslim.Config({', '.join(changed)})"

    def __eq__(self, other) -> bool:
        return isinstance(other, Config) and self._c.fields() == other._c.fields()

    def __dir__(self):
        return list(_TYPES) + ["validate", "fields", "copy", "from_spec"]
