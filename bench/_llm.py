"""An engine as NAME_llm's `initialize` makes one, from an exported repository's NAME_llm config and graphs."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def llm_config(repo: Path) -> tuple[dict[str, str], Path, object]:
    """NAME_llm's config parameters, its newest version folder, and the ONNX Runtime session options it runs with."""
    import onnxruntime as ort
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    folder = next(p for p in repo.iterdir() if p.name.endswith("_llm"))
    config = text_format.Parse((folder / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    params = {k: v.string_value for k, v in config.parameters.items()}
    version = max((p for p in folder.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    sys.path.insert(0, str(version))
    from ort_options import session_options

    return params, version, session_options(ort)


def llm_engine(session, params: dict[str, str], speculation, **more):
    """The engine on `session` with NAME_llm's batch, cache and prefix-cache parameters (`more`: engine_for's
    other arguments, as `mtp`)."""
    from dstool.decoding.engine import PrefixCache, engine_for

    shapes = {k: tuple(v) for k, v in json.loads(params["empty_cache"]).items()}
    prefix = int(params["prefix_cache_tokens"])
    return engine_for(session, shapes, int(params["max_batch"]), int(params["max_cache_tokens"]),
                      int(params["max_prefill_tokens"]),
                      PrefixCache(int(params["prefix_cache_block"]), prefix) if prefix else None, speculation, **more)
