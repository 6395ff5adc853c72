"""Run by bench/compress.py inside bench/.optimum-venv (optimum-onnx needs transformers<4.58, dstool uses 5.x):
Hugging Face Optimum's ORTQuantizer, dynamic int8, per-channel, the AutoQuantizationConfig for this CPU.

    python bench/_optimum_quantize.py ONNX_DIR OUT_DIR
"""

import sys
from pathlib import Path

from optimum.onnxruntime import ORTQuantizer
from optimum.onnxruntime.configuration import AutoQuantizationConfig

src, out = Path(sys.argv[1]), Path(sys.argv[2])
flags = open("/proc/cpuinfo").read()
make = AutoQuantizationConfig.avx512_vnni if "avx512_vnni" in flags else AutoQuantizationConfig.avx2
config = make(is_static=False, per_channel=True)
ORTQuantizer.from_pretrained(src, file_name="model.onnx").quantize(save_dir=out, quantization_config=config)
print(f"optimum: {make.__name__}, wrote {sorted(p.name for p in out.iterdir())}")
