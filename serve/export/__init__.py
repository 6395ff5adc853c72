"""dstool.serve.export: what `dstool export` writes from a compress output or a Hugging Face folder.

    from dstool.serve.export import export, export_edge
    deployment = export(ExportConfig(model="runs/int8", repository="models"))

Modules: source (what an export reads), api (`export`: a new version in a Triton model repository), repository
(the model folders, their configs built as Triton's ModelConfig), edge_package and edge_split (`--target edge`:
an ONNX Runtime-format package cut into blocks).
"""

from dstool.serve.export.api import export
from dstool.serve.export.edge_package import export_edge

__all__ = ["export", "export_edge"]
