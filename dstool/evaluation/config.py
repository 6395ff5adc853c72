"""`EvalConfig`: the options of `dstool eval`, validated; importing it loads nothing but pydantic (fast CLI errors)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from dstool.config import CommandConfig

TASK_NAMES = ("sotu_ppl", "sotu_cloze", "convo_mc", "convo_chat")


class EvalConfig(CommandConfig):
    """Options of `dstool eval` (field names are the flags with dashes)."""

    model: str = Field(description="what to score: a Hugging Face folder, a .gguf or smollm2 (lm-eval's hf model, "
                       "fp32 on the CPU); a dstool compress output or an .onnx logits graph (lm-eval's onnxruntime "
                       "model on the graph); with --url, the folder whose tokenizer the served model uses",
                       json_schema_extra={"cli": {"metavar": "PATH_OR_NAME"}})
    tasks: list[str] = Field(list(TASK_NAMES), description=f"tasks to run, repeated or comma-separated: "
                             f"{', '.join(TASK_NAMES)} (docs/eval.md)", json_schema_extra={"cli": {"metavar": "TASK"}})
    url: str | None = Field(None, description="score a served model instead: its OpenAI /v1/completions URL (dstool "
                            "serve's gateway, e.g. http://127.0.0.1:8000/v1/completions), with lm-eval's "
                            "local-completions", json_schema_extra={"cli": {"metavar": "URL"}})
    served_model: str | None = Field(None, description="--url: the model's name on that server (GET /v1/models)",
                                     json_schema_extra={"cli": {"metavar": "NAME"}})
    tokenizer: str | None = Field(None, description="the tokenizer's folder, where --model does not say it (an .onnx "
                                  "file outside a compress output)", json_schema_extra={"cli": {"metavar": "DIR"}})
    limit: int | None = Field(None, ge=1, description="score only the first N documents of each task")
    output: str = Field("runs/eval", description="folder for results.json, the tasks' documents (tasks/) and the logs")
    batch_size: int = Field(8, ge=1, le=64, description="requests per forward pass (hf) or per HTTP request (--url); "
                            "lm-eval's onnxruntime model scores one at a time")
    max_length: int = Field(2048, ge=16, description="tokens per forward pass: longer documents are scored in "
                            "rolling windows of this length")
    lm_eval_venv: str | None = Field(None, description="lm-evaluation-harness's own virtual environment "
                                     "(scripts/lm-eval-venv.sh makes it) [default: $DSTOOL_LM_EVAL_VENV, else "
                                     "<dstool cache>/lm-eval-venv]", json_schema_extra={"cli": {"metavar": "DIR"}})

    @field_validator("tasks", mode="before")
    @classmethod
    def _split(cls, v):  # --tasks a,b --tasks c; YAML: a list or "a,b"
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list):
            return v
        return [t for item in items for t in re.split(r"[,\s]+", str(item)) if t]

    @model_validator(mode="after")
    def _check(self) -> EvalConfig:
        unknown = [t for t in self.tasks if t not in TASK_NAMES]
        if unknown:
            raise ValueError(f"unknown task '{unknown[0]}': choose from {', '.join(TASK_NAMES)}")
        if not self.tasks:
            raise ValueError(f"no tasks: give --tasks with some of {', '.join(TASK_NAMES)}")
        if len(set(self.tasks)) != len(self.tasks):
            raise ValueError("a task is given twice in --tasks")
        if self.served_model is not None and self.url is None:
            raise ValueError("--served-model names the model of --url: give --url with it")
        if self.url is not None:
            if not re.fullmatch(r"https?://[^/\s]+(/v1(/completions)?)?/?", self.url):
                raise ValueError(f"url must be http(s)://HOST:PORT/v1/completions (an OpenAI completions route), "
                                 f"got '{self.url}'")
            if not self.served_model:
                raise ValueError("--url needs --served-model: the model's name on that server (GET /v1/models)")
        return self

    @property
    def completions_url(self) -> str | None:
        """--url as the full /v1/completions URL."""
        if self.url is None:
            return None
        base = re.sub(r"(/v1)?(/completions)?/?$", "", self.url)
        return base + "/v1/completions"
