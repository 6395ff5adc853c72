"""The lm-evaluation-harness side of `dstool eval`: run by the python of lm-eval's own virtual environment
(scripts/lm-eval-venv.sh; its pins are not dstool's), never imported by dstool. Standard library and lm_eval only.

    LM_EVAL_VENV/bin/python harness.py SPEC.json

SPEC names the backend and its arguments, the task folder (lm-eval's --include_path), the plain tasks and the
chat-template tasks, the limit and where to write the results. Backends, all lm-eval's own scoring code:

  hf           lm-eval's `hf` model (transformers, CPU, fp32) on a Hugging Face folder
  onnx         lm-eval's `onnxruntime` model (a plain InferenceSession on CPU) on an ONNX logits graph
               (input_ids [batch, seq] -> logits [batch, seq, vocab]), its tokenizer from a given folder: the class
               below, registered as `dstool-onnx`, adds only that and the chat template
  completions  lm-eval's `local-completions` against an OpenAI /v1/completions route (echo + prompt logprobs)

The plain tasks are scored in one simple_evaluate call, the chat tasks in a second with apply_chat_template, on the
same model object. The results file holds, per task, lm-eval's metrics and stderrs, its document counts, and each
document's responses (log-likelihoods).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _onnx_class():
    from lm_eval.api.registry import register_model
    from lm_eval.models.onnxruntime_ort import ONNXRuntimeLM

    @register_model("dstool-onnx")
    class DstoolOnnxLM(ONNXRuntimeLM):
        """lm-eval's ONNX Runtime model on a graph whose tokenizer lives in another folder (a compress output keeps
        its graphs in onnx/ and its tokenizer in model/), with the tokenizer's chat template."""

        def __init__(self, pretrained: str, tokenizer: str, **kwargs):
            self._tokenizer_dir = tokenizer
            super().__init__(pretrained=pretrained, **kwargs)

        def _load_tokenizer(self) -> None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_dir)
            eos, bos = self.tokenizer.eos_token_id, self.tokenizer.bos_token_id
            if getattr(self, "_eot_token_id", None) is None:  # as lm-eval's own: the tokenizer's, without a
                self._eot_token_id = eos if eos is not None else 0  # genai_config.json
            if getattr(self, "_bos_token_id", None) is None:
                self._bos_token_id = bos

        @property
        def tokenizer_name(self) -> str:
            return str(self._tokenizer_dir).replace("/", "__")

        def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
            return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=not add_generation_prompt)

    return DstoolOnnxLM


def make_model(spec: dict):
    backend, max_length, batch = spec["backend"], int(spec["max_length"]), int(spec["batch_size"])
    if backend == "hf":
        from lm_eval.models.huggingface import HFLM

        return HFLM(pretrained=spec["model"], device="cpu", dtype="float32", batch_size=batch, max_length=max_length)
    if backend == "onnx":
        return _onnx_class()(pretrained=spec["model"], tokenizer=spec["tokenizer"], execution_provider="cpu",
                             max_length=max_length)
    if backend == "completions":
        from lm_eval.models.openai_completions import LocalCompletionsAPI

        # TemplateAPI keeps one position for the generated token (max_length - 1): the same windows as the others
        return LocalCompletionsAPI(model=spec["served_model"], base_url=spec["url"], tokenizer=spec["tokenizer"],
                                   tokenizer_backend="huggingface", max_length=max_length + 1, batch_size=batch,
                                   num_concurrent=1, max_retries=2, timeout=600)
    raise SystemExit(f"unknown backend {backend!r}")


def _float(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _response(r) -> list:
    """One request's response as [log-likelihood] or [log-likelihood, greedy] (lm-eval: a list of repeats)."""
    r = r[0] if isinstance(r, list) and len(r) == 1 else r
    return [float(r[0]), bool(r[1])] if isinstance(r, (list, tuple)) else [float(r)]


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import lm_eval
    from lm_eval.tasks import TaskManager

    started = time.perf_counter()
    lm = make_model(spec)
    loaded = time.perf_counter() - started
    manager = TaskManager(include_path=spec["include_path"], include_defaults=False)
    out: dict = {"tasks": {}, "lm_eval": getattr(lm_eval, "__version__", "?"), "load_s": round(loaded, 2)}
    for chat, names in ((False, spec["tasks"]), (True, spec["chat_tasks"])):
        if not names:
            continue
        t0 = time.perf_counter()
        results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=spec["limit"],
                                          apply_chat_template=chat, bootstrap_iters=spec["bootstrap_iters"],
                                          log_samples=True, num_fewshot=0)
        seconds = time.perf_counter() - t0
        assert results is not None
        for name in names:
            metrics = {k.split(",")[0]: _float(v) for k, v in results["results"][name].items() if "," in k}
            samples = sorted(results["samples"][name], key=lambda s: s["doc_id"])
            out["tasks"][name] = {
                "metrics": metrics, "docs": results["n-samples"][name]["effective"],
                "docs_available": results["n-samples"][name]["original"], "chat_template": chat,
                "seconds": round(seconds / len(names), 2),  # the call's time shared by its tasks
                "responses": [[_response(r) for r in s["resps"]] for s in samples]}
    out["seconds"] = round(time.perf_counter() - started, 2)
    Path(spec["output"]).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1]))
