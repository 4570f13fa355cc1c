"""safetensors files, the format of the Hugging Face hub: one `.safetensors` file,
or a sharded checkpoint (`model.safetensors.index.json` naming the shard of each
entry), read and written through the `safetensors` package (an optional
dependency: `pip install "jaxstate[safetensors]"`).

safetensors stores named arrays and a header of text metadata; PRNG keys are
written as their key data, with their implementation in the metadata
(`"jaxstate.keys"`), and read back as keys.
"""

import json
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._tree._values import is_key_dtype, key_impl, to_host
from ._files import atomic_write


try:
    import safetensors
    import safetensors.numpy
except ImportError:  # optional: only the functions below need it
    safetensors = None

_KEYS = "jaxstate.keys"
_INSTALL = 'pip install "jaxstate[safetensors]"'


def is_safetensors(path: str | pathlib.Path) -> bool:
    """Whether `path` is to be read as safetensors: by its name (a `.safetensors`
    file or a shards' `.json` index), or, whatever its name, by its first bytes (a
    header length, then the header's `{`)."""
    name = str(path)
    if name.endswith((".safetensors", ".json")):
        return True
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    # Not a zip (`.npz`) nor a NumPy stream (Equinox's), whatever their 9th byte.
    foreign = head.startswith((b"PK", b"\x93NUMPY"))
    return len(head) == 9 and head[8:] == b"{" and not foreign


def _package(fn: str) -> Any:
    if safetensors is None:
        raise ImportError(
            f"`{fn}`: safetensors files need the `safetensors` package: {_INSTALL}."
        )
    return safetensors


def _damaged(fn: str, path: Any, why: str) -> ValueError:
    return ValueError(
        f"`{fn}`: {str(path)!r} cannot be read as a safetensors checkpoint: {why}. "
        "Nothing was loaded."
    )


def _read_file(
    path: pathlib.Path, fn: str, names: list[str] | None = None
) -> dict[str, Any]:
    """The entries of one `.safetensors` file (`names` only, if given)."""
    package = _package(fn)
    out: dict[str, Any] = {}
    absent: list[str] = []
    try:
        with package.safe_open(str(path), framework="numpy") as f:
            keys = json.loads((f.metadata() or {}).get(_KEYS, "{}"))
            available = list(f.keys())
            wanted = available if names is None else names
            absent = [n for n in wanted if n not in set(available)]
            for name in wanted if not absent else ():
                try:
                    value = f.get_tensor(name)
                except Exception as e:
                    dtype = f.get_slice(name).get_dtype()
                    raise _Entry(name, dtype, e) from e
                if name in keys:
                    value = jax.random.wrap_key_data(
                        jnp.asarray(value), impl=keys[name]
                    )
                out[name] = value
    except FileNotFoundError:
        raise
    except _Entry as e:
        raise _damaged(
            fn,
            path,
            f"the safetensors package cannot read its entry {e.name!r} ({e.dtype}) "
            f"into NumPy ({type(e.error).__name__}: {e.error})",
        ) from e.error
    except Exception as e:  # the package's `SafetensorError`, a bad header, ...
        raise _damaged(fn, path, f"{type(e).__name__}: {e}") from e
    if absent:
        raise _damaged(
            fn, path, f"its index lists {absent[:5]}, which it does not hold"
        )
    return out


class _Entry(Exception):
    """An entry the package could not read."""

    def __init__(self, name: str, dtype: str, error: Exception):
        super().__init__(name)
        self.name, self.dtype, self.error = name, dtype, error


def read_safetensors(path: str | pathlib.Path, fn: str) -> dict[str, Any]:
    """The entries of a `.safetensors` file, or of the shards a `.json` index
    names, each shard opened once; `fn` begins the messages."""
    path = pathlib.Path(path)
    if not str(path).endswith(".json"):
        return _read_file(path, fn)
    _package(fn)
    try:
        index = json.loads(path.read_text())
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise TypeError("`weight_map` must map names to file names")
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise _damaged(
            fn, path, f"it is not a shards' index ({type(e).__name__}: {e})"
        ) from e
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    read: dict[str, Any] = {}
    for shard, names in shards.items():
        shard_path = path.parent / shard
        if not shard_path.is_file():
            raise _damaged(fn, path, f"its shard {str(shard_path)!r} does not exist")
        read.update(_read_file(shard_path, fn, names))
    return {name: read[name] for name in weight_map}


def write_safetensors(path: str | pathlib.Path, mapping: Mapping[str, Any]) -> None:
    """`mapping` as one `.safetensors` file, written atomically."""
    fn = "jaxstate.write_state_dict"
    package = _package(fn)
    arrays: dict[str, np.ndarray] = {}
    keys: dict[str, str] = {}
    for name, value in mapping.items():
        if isinstance(value, jax.Array) and is_key_dtype(value.dtype):
            keys[name] = key_impl(value.dtype)
        arrays[name] = np.asarray(to_host(value), order="C")  # 0-d stays 0-d
        if arrays[name].dtype.name.startswith(("float8", "float4")):
            # The package writes them, but cannot read them back into NumPy.
            raise ValueError(
                f"`{fn}`: entry {name!r} is {arrays[name].dtype}, which safetensors "
                "cannot read: write an `.npz`."
            )
    metadata = {"format": "np"}
    if keys:
        metadata[_KEYS] = json.dumps(keys)
    try:
        data = package.numpy.save(arrays, metadata=metadata)
    except Exception as e:  # the package's `SafetensorError`: a dtype it lacks
        raise ValueError(
            f"`{fn}`: safetensors cannot store these arrays ({e}): write an `.npz`."
        ) from e
    with atomic_write(path) as f:
        f.write(data)
