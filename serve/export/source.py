"""What an export reads: a `dstool compress` output through its manifest (CompressedModel), or a Hugging Face
folder, exported to ONNX here (fp32, each graph parity-checked against PyTorch); and the generation facts of its
config (end-of-sequence ids, positions)."""

from __future__ import annotations

import json
from pathlib import Path

from dstool import artifacts
from dstool import log as dlog
from dstool.artifacts import CompressedModel, ManifestError
from dstool.decoding.engine import Speculation
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


def check_speculation(config: str | None, hf_dir: Path | None) -> None:
    """A speculative_config drafting with the MTP module (vLLM's deepseek_mtp) needs a Hugging Face folder that has
    one (`num_nextn_predict_layers`; a compress output's graphs have none): a one-line UsageError otherwise."""
    speculation = Speculation.parse(config) if config else None
    if speculation is None or not speculation.mtp:
        return
    from dstool.onnx_export import mtp_depths  # noqa: PLC0415 (dstool.onnx_export imports torch)

    try:
        speculation.check_mtp(mtp_depths(hf_dir) if hf_dir else 0)
    except ValueError as e:
        raise UsageError(f"speculative_config: {e}") from None


def onnx_graphs(hf_dir: Path, work: Path, roles: tuple[str, ...] = ("logits", "decoder"),
                lora: bool = False) -> dict[str, Path]:
    """fp32 ONNX graphs of a Hugging Face folder written under `work` (`logits`: token ids -> logits, cut from the
    decoder graph; `decoder`: the key/value-cache decoder; `fused`: the fused-attention decoder, where the
    architecture has one, with LoRA inputs when `lora`; `mtp1`..`mtpD`: a DeepSeek-V3 folder's MTP depths as draft
    graphs, its decoder then also giving `hidden_states`), each parity-checked against PyTorch."""
    import torch  # the export extra: a serving install exports compress outputs without it
    from transformers import AutoModelForCausalLM

    from dstool import logits_graph  # noqa: PLC0415 (dstool.logits_graph imports dstool.onnx_export)
    from dstool.onnx_export import (  # noqa: PLC0415 (dstool.onnx_export imports torch)
        export_decoder_model,
        export_mtp_graph,
        expose_hidden_states,
        mtp_drafts,
    )

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    dlog.adopt_libraries()
    graphs = {}
    if "decoder" in roles or "logits" in roles:  # the logits graph is cut from the decoder graph
        log.info("dstool export: ONNX decoder with key/value cache (parity-checked on prefill and decoding steps)")
        decoder = export_decoder_model(model, work / "decoder")
        graphs["decoder"] = decoder.path
        if "logits" in roles:  # before the MTP depths add the decoder's hidden_states
            log.info("dstool export: ONNX logits model, cut from the decoder (parity-checked against PyTorch)")
            graphs["logits"] = logits_graph.from_decoder(model, decoder, work / "logits").path
        for k, draft in enumerate(mtp_drafts(model, hf_dir), start=1):  # DeepSeek's MTP depths, where it has them
            if k == 1:
                log.info("dstool export: the decoder's last hidden state as an output, and the MTP module as draft "
                         "graphs (parity-checked on prefill and decoding steps)")
                expose_hidden_states(model, graphs["decoder"])
            graphs[f"mtp{k}"] = export_mtp_graph(draft, work / f"mtp{k}").path
    if "fused" in roles:
        from dstool.fused_decoder import export_fused_decoder, unsupported  # noqa: PLC0415 (dstool.fused_decoder imports torch)

        why = unsupported(model.config)
        if why and lora:
            raise UsageError(f"--adapter and --enable-lora serve adapters on the fused-attention decoder, which "
                             f"{hf_dir} cannot have ({why}): merge the adapter into the model and export that")
        if why:
            log.info(f"dstool export: no fused-attention decoder ({why}): NAME_llm runs the decoder above")
        else:
            log.info("dstool export: fused-attention decoder for NAME_llm (parity-checked on prefill, decoding steps "
                     "and a chunk after cached positions)")
            graphs["fused"] = export_fused_decoder(model, work / "fused", lora=lora).path
    return graphs
