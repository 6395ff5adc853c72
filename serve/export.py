"""`export(config)`: what `dstool export` does, callable from Python.

The input is read through its manifest: a `dstool compress` output (CompressedModel) names both of its graphs,
quantized or pruned by compress, and they are deployed as they are; a Hugging Face folder (a `dstool train`
model, or any causal LM) is exported to ONNX here, fp32, both graphs parity-checked against PyTorch. The
repository's manifest then records what each deployed version is made of.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from dstool import artifacts
from dstool import log as dlog
from dstool.artifacts import CompressedModel, Deployment, ManifestError, Repository
from dstool.errors import UsageError
from dstool.files import sha256_file
from dstool.serve import repository
from dstool.serve.config import ExportConfig

log = dlog.log


def _generation_facts(hf_dir: Path) -> tuple[list[int], int]:
    """(end-of-sequence ids, positions) from the Hugging Face folder's config files."""
    config = json.loads((hf_dir / "config.json").read_text())
    generation = hf_dir / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    eos = config.get("eos_token_id") if eos is None else eos
    return ([eos] if isinstance(eos, int) else list(eos or [])), int(config["max_position_embeddings"])


def _input(source: Path) -> CompressedModel | None:
    """The compress manifest of `source`, None for a Hugging Face folder; a one-line UsageError otherwise."""
    from dstool import models

    if not source.is_dir():
        raise UsageError(f"model {source} is not a folder: pass a Hugging Face folder or a dstool compress output")
    kind = artifacts.kind_of(source)
    if kind == "compressed-model":
        try:
            return CompressedModel.read(source, verify=True)
        except ManifestError as e:
            raise UsageError(str(e)) from None
    if (source / "config.json").is_file():
        models.check_model_folder(source)
        return None
    if (source / "onnx").is_dir() or (source / "report.json").is_file():
        raise UsageError(f"{source} looks like the output of an older dstool compress, which wrote no manifest: "
                         "re-run `dstool compress` on its model to redo it")
    raise UsageError(f"model {source} is neither a Hugging Face folder (no config.json) nor a dstool compress output"
                     + (artifacts.model_hint(source) or f" (no {artifacts.MANIFEST})"))


def export(cfg: ExportConfig) -> Deployment:
    """Write a new version of model `cfg.name` (token ids -> logits) and of its text-generation models (tokenizer,
    key/value-cache decoder, detokenizer, `NAME_generate`) into the Triton repository; returns what was deployed.
    (`cfg.target` edge: `dstool.serve.edge_export.export_edge`.)"""
    if cfg.target != "triton":
        raise UsageError("export() writes a Triton repository: call dstool.serve.edge_export.export_edge for "
                         "--target edge")
    repo = Path(cfg.repository)
    if repo.exists() and not repo.is_dir():
        raise UsageError(f"repository {repo} is a file: pass a folder for --repository")
    source = Path(cfg.model)
    compressed = _input(source)
    hf_dir = source / compressed.model if compressed else source
    work = Path(tempfile.mkdtemp(prefix="dstool-export-"))
    try:
        if compressed:
            logits, decoder = (source / compressed.graphs[role].path for role in ("logits", "decoder"))
            log.info(f"dstool export: the graphs of {source} as its manifest names them ({_recipe_label(compressed)})")
        else:
            logits, decoder = _export_graphs(hf_dir, work)
        eos, positions = _generation_facts(hf_dir)
        repo.mkdir(parents=True, exist_ok=True)
        dlog.to_file(repo / "dstool-export.log")
        placed = repository.write_repository(repo, cfg.settings(), repository.Artefacts(
            logits_onnx=logits, decoder_onnx=decoder, tokenizer_dir=hf_dir, eos_token_ids=eos,
            max_positions=positions))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    version = int(placed["logits"].name)
    deployment = Deployment(
        name=cfg.name, version=version, models=repository.model_names(cfg.name),
        source=compressed.source if compressed else artifacts.source_model(hf_dir),
        compressed=str(source.resolve()) if compressed else None, recipe=compressed.recipe if compressed else None,
        graphs={role: sha256_file(placed[role] / "model.onnx") for role in ("logits", "decoder")},
        settings=cfg.model_dump(mode="json", exclude={"model", "repository"}))
    _record(repo, deployment)
    log.info(f"dstool export: {repo} version {version} of {', '.join(p.parent.name for p in placed.values())} "
             f"({cfg.backend} backend, max_batch_size {cfg.max_batch_size}, {cfg.instances} instance(s); every config "
             f"built as Triton's ModelConfig and checked against the ONNX graphs)")
    return deployment


def _recipe_label(m: CompressedModel) -> str:
    r = m.recipe
    parts = [f"{r.quantization.bits}-bit {r.quantization.engine}" if r.quantization else "",
             f"pruned {r.pruning.decoder_fraction_removed:.0%}" if r.pruning else "",
             f"{r.sparsity.pattern} sparse" if r.sparsity else ""]
    return ", ".join(p for p in parts if p) or "fp32"


def _export_graphs(hf_dir: Path, work: Path) -> tuple[Path, Path]:
    """fp32 logits and decoder graphs of a Hugging Face folder, each parity-checked against PyTorch."""
    import torch
    from transformers import AutoModelForCausalLM

    from dstool.onnx_export import export_decoder_model, export_logits_model

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    dlog.adopt_libraries()
    log.info("dstool export: ONNX logits model (parity-checked against PyTorch)")
    logits = export_logits_model(model, work / "logits").path
    log.info("dstool export: ONNX decoder with key/value cache (parity-checked on prefill and decoding steps)")
    decoder = export_decoder_model(model, work / "decoder").path
    return logits, decoder


def _record(repo: Path, deployment: Deployment) -> None:
    """Add `deployment` to the repository's manifest (a foreign or older one is replaced, with a warning)."""
    try:
        manifest = Repository.read(repo)
    except ManifestError as e:
        if (repo / artifacts.MANIFEST).exists():
            log.warning(f"{e}; writing a new repository manifest")
        manifest = Repository()
    manifest.deployments = [d for d in manifest.deployments
                            if (d.name, d.version) != (deployment.name, deployment.version)] + [deployment]
    manifest.write(repo, hash_files=False)
