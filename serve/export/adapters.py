"""The LoRA adapters an export serves beside its base (`--adapter NAME=FOLDER`): each read as NAME_llm will read it,
checked against the fused decoder's LoRA inputs, and its logits there checked against PEFT's merge of it into the
base model (the same bound as the export's other graphs)."""

from __future__ import annotations

import copy
from pathlib import Path

from dstool import log as dlog
from dstool.decoding.adapters import Adapter, graph_layout, read_config
from dstool.decoding.errors import AdapterError
from dstool.errors import UsageError

log = dlog.log


def precheck_adapters(adapters: list[str], max_rank: int) -> None:
    """Each NAME=FOLDER's files and config, before any graph is made (UsageError naming what is wrong)."""
    for item in adapters:
        name, _, folder = item.partition("=")
        try:
            read_config(name, Path(folder), max_rank)
        except AdapterError as e:
            raise UsageError(f"--adapter {e}") from None


def check_adapters(adapters: list[str], hf_dir: Path, fused: Path, max_rank: int,
                   tolerance: float = 1e-3) -> dict[str, Adapter]:
    """name -> the adapter, for each NAME=FOLDER of `adapters`, served by `fused` (the base `hf_dir`'s graph)."""
    if not adapters:
        return {}
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dstool.fused_decoder import adapter_parity  # noqa: PLC0415 (dstool.fused_decoder imports torch)
    from dstool.onnx_export import ort_session  # noqa: PLC0415 (dstool.onnx_export imports torch)

    layout = graph_layout(ort_session(fused).get_inputs())
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)  # read once; a copy merges each
    loaded = {}
    for item in adapters:
        name, _, folder = item.partition("=")
        try:
            adapter = Adapter.load(name, Path(folder), layout, max_rank)
        except AdapterError as e:
            raise UsageError(f"--adapter {e}") from None
        merged = PeftModel.from_pretrained(copy.deepcopy(base), folder).merge_and_unload().eval()
        adapter_parity(merged, fused, adapter).check(tolerance, f"adapter {name!r} on the fused decoder (against "
                                                                "PEFT's merge)")
        log.info(f"dstool export: adapter {name!r} (rank {adapter.rank}, {', '.join(adapter.targets)}) matches "
                 "PEFT's merge of it")
        loaded[name] = adapter
    return loaded
