"""`export(config)`: what `dstool export` does, callable from Python.

The input is read through its manifest: a `dstool compress` output (CompressedModel) names both of its graphs,
quantized or pruned by compress, and they are deployed as they are; a Hugging Face folder (a `dstool train`
model, or any causal LM) is exported to ONNX here, fp32, both graphs parity-checked against PyTorch. The
repository's manifest then records what each deployed version is made of.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from dstool import artifacts, gguf
from dstool import log as dlog
from dstool.artifacts import CompressedModel, Deployment, ManifestError, Repository
from dstool.errors import UsageError
from dstool.files import sha256_file
from dstool.serve.config.export_config import ExportConfig
from dstool.serve.export import repository
from dstool.serve.export.adapters import check_adapters, precheck_adapters
from dstool.serve.export.source import check_speculation, generation_facts, onnx_graphs, read_source

log = dlog.log


def export(cfg: ExportConfig) -> Deployment:
    """Write a new version of model `cfg.name` (token ids -> logits) and of its text-generation models (tokenizer,
    key/value-cache decoder, detokenizer, `NAME_generate`) into the Triton repository; returns what was deployed.
    (`cfg.target` edge: `dstool.serve.export.export_edge`.)"""
    if cfg.target != "triton":
        raise UsageError("export() writes a Triton repository: call dstool.serve.export.export_edge for "
                         "--target edge")
    repo = Path(cfg.repository)
    if repo.exists() and not repo.is_dir():
        raise UsageError(f"repository {repo} is a file: pass a folder for --repository")
    cfg = cfg.model_copy(update={"model": gguf.resolve(cfg.model)})
    source = Path(cfg.model)
    compressed = read_source(source)
    hf_dir = source / compressed.model if compressed else source
    lora = cfg.settings().enable_lora
    if lora and (compressed or not cfg.fused_attention):
        raise UsageError("--adapter and --enable-lora serve adapters on an fp32 fused-attention decoder: export a "
                         "Hugging Face folder (not a compress output), without --no-fused-attention")
    precheck_adapters(cfg.adapters, cfg.max_lora_rank)  # before the graphs are made
    check_speculation(cfg.speculative_config, None if compressed else hf_dir)
    work = Path(tempfile.mkdtemp(prefix="dstool-export-"))
    try:
        fused, mtp = None, []
        if compressed:
            logits, decoder = (source / compressed.graphs[role].path for role in ("logits", "decoder"))
            if cfg.fused_attention and "fused" in compressed.graphs:
                fused = source / compressed.graphs["fused"].path
            log.info(f"dstool export: the graphs of {source} as its manifest names them ({_recipe_label(compressed)}"
                     + ("; NAME_llm runs its fused-attention decoder)" if fused else
                        "; NAME_llm runs its decoder graph: " + ("--no-fused-attention)" if not cfg.fused_attention
                                                                 else "it has no fused-attention decoder)")))
        else:
            graphs = onnx_graphs(hf_dir, work, ("logits", "decoder", "fused") if cfg.fused_attention else
                                 ("logits", "decoder"), lora=lora)
            logits, decoder, fused = graphs["logits"], graphs["decoder"], graphs.get("fused")
            mtp = [graphs[f"mtp{k}"] for k in range(1, len(graphs) + 1) if f"mtp{k}" in graphs]
        adapters = check_adapters(cfg.adapters, hf_dir, fused, cfg.max_lora_rank) if fused else {}
        eos, positions = generation_facts(hf_dir)
        repo.mkdir(parents=True, exist_ok=True)
        dlog.to_file(repo / "dstool-export.log")
        placed = repository.write_repository(repo, cfg.settings(), repository.Artefacts(
            logits_onnx=logits, decoder_onnx=decoder, tokenizer_dir=hf_dir, eos_token_ids=eos,
            max_positions=positions, fused_onnx=fused,
            adapters={name: Path(a.path) for name, a in adapters.items()}, mtp_onnx=mtp))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    version = int(placed["logits"].name)
    deployment = Deployment(
        name=cfg.name, version=version, models=repository.model_names(cfg.name),
        source=compressed.source if compressed else artifacts.source_model(hf_dir),
        compressed=str(source.resolve()) if compressed else None, recipe=compressed.recipe if compressed else None,
        graphs={**{role: sha256_file(placed[role] / "model.onnx") for role in ("logits", "decoder")},
                **({"fused": sha256_file(placed["llm"] / "fused" / "model.onnx")} if fused else {}),
                **{f"mtp{k}": sha256_file(placed["llm"] / "mtp" / str(k) / "model.onnx")
                   for k in range(1, len(mtp) + 1)}},
        settings=cfg.model_dump(mode="json", exclude={"model", "repository"}),
        adapters={name: a.sha256 for name, a in adapters.items()})
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
