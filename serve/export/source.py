"""What an export reads: a `dstool compress` output through its manifest (CompressedModel), or a Hugging Face
folder, exported to ONNX here (fp32, each graph parity-checked against PyTorch); and the generation facts of its
config (end-of-sequence ids, positions)."""

from __future__ import annotations

import json
from pathlib import Path

from dstool import artifacts
from dstool import log as dlog
from dstool.artifacts import CompressedModel, ManifestError
from dstool.errors import UsageError

log = dlog.log


def read_source(source: Path) -> CompressedModel | None:
    """The compress manifest of `source`, None for a Hugging Face folder; a one-line UsageError otherwise."""
    from dstool import models  # noqa: PLC0415 (imports transformers: a compress output is read without it)

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


def generation_facts(hf_dir: Path) -> tuple[list[int], int]:
    """(end-of-sequence ids, positions) from the Hugging Face folder's config files."""
    config = json.loads((hf_dir / "config.json").read_text())
    generation = hf_dir / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.is_file() else None
    eos = config.get("eos_token_id") if eos is None else eos
    return ([eos] if isinstance(eos, int) else list(eos or [])), int(config["max_position_embeddings"])


def onnx_graphs(hf_dir: Path, work: Path, roles: tuple[str, ...] = ("logits", "decoder")) -> dict[str, Path]:
    """fp32 ONNX graphs of a Hugging Face folder written under `work` (`logits`: token ids -> logits; `decoder`: the
    key/value-cache decoder; `fused`: the fused-attention decoder, where the architecture has one), each
    parity-checked against PyTorch."""
    import torch  # the export extra: a serving install exports compress outputs without it
    from transformers import AutoModelForCausalLM

    from dstool.onnx_export import export_decoder_model, export_logits_model  # noqa: PLC0415 (dstool.onnx_export imports torch)

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    dlog.adopt_libraries()
    graphs = {}
    if "logits" in roles:
        log.info("dstool export: ONNX logits model (parity-checked against PyTorch)")
        graphs["logits"] = export_logits_model(model, work / "logits").path
    if "decoder" in roles:
        log.info("dstool export: ONNX decoder with key/value cache (parity-checked on prefill and decoding steps)")
        graphs["decoder"] = export_decoder_model(model, work / "decoder").path
    if "fused" in roles:
        from dstool.fused_decoder import export_fused_decoder, unsupported  # noqa: PLC0415 (dstool.fused_decoder imports torch)

        why = unsupported(model.config)
        if why:
            log.info(f"dstool export: no fused-attention decoder ({why}): NAME_llm runs the decoder above")
        else:
            log.info("dstool export: fused-attention decoder for NAME_llm (parity-checked on prefill, decoding steps "
                     "and a chunk after cached positions)")
            graphs["fused"] = export_fused_decoder(model, work / "fused").path
    return graphs
