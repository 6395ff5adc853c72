"""Triton python-backend model: text -> token ids with the model's own Hugging Face tokenizer (the files
in its version folder), exactly as `AutoTokenizer(text)` tokenizes for PyTorch."""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


class TritonPythonModel:
    def initialize(self, args):
        self.tokenizer = AutoTokenizer.from_pretrained(os.path.join(args["model_repository"], args["model_version"]))
        params = json.loads(args["model_config"]).get("parameters", {})
        # text longer than any prompt the model can take is refused untokenized (none: a repository exported before)
        self.limit = int(params["max_prompt_bytes"]["string_value"]) if "max_prompt_bytes" in params else None

    def execute(self, requests):
        responses = []
        for r in requests:
            text = pb_utils.get_input_tensor_by_name(r, "text_input").as_numpy().reshape(-1)[0]
            if self.limit is not None and len(text) > self.limit:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    f"text_input is {len(text)} bytes: more than the model's positions can hold (at most "
                    f"{self.limit} bytes); shorten it", pb_utils.TritonError.INVALID_ARG)))
                continue
            try:
                text = text.decode("utf-8") if isinstance(text, bytes) else str(text)
            except UnicodeDecodeError as e:
                message = f"text_input is not valid UTF-8 (byte {e.start}): send UTF-8 text"
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG)))
                continue
            ids = np.asarray(self.tokenizer(text)["input_ids"], dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", ids)]))
        return responses
