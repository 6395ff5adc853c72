"""The options of the clients: `dstool infer` and `dstool batch`, and the sampling they ask for."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from dstool.config import CommandConfig, positional
from dstool.serve.config.gateway_config import host_port


class SamplingOptions(CommandConfig):
    """How generated tokens are chosen (greedy unless one of these asks to sample), as the models' request
    parameters."""

    temperature: float | None = Field(None, ge=0, le=100, description="sample at this temperature (0: greedy)")
    top_k: int | None = Field(None, ge=0, description="sample from the k most likely tokens")
    top_p: float | None = Field(None, gt=0, le=1, description="sample from the smallest set this likely")
    min_p: float | None = Field(None, ge=0, le=1, description="drop tokens below this share of the most likely")
    repetition_penalty: float | None = Field(None, gt=0, description="penalize tokens already in prompt or output")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="OpenAI's presence penalty")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="OpenAI's frequency penalty")
    seed: int | None = Field(None, ge=0, description="the same seed, the same sampled text")
    json_schema: str | None = Field(None, description="a JSON schema file the answer must follow (structured "
                                    "outputs: enforced by the grammar engine while sampling)",
                                    json_schema_extra={"cli": {"metavar": "FILE"}})

    def structured(self) -> dict | None:
        """--json-schema as the models' structured_outputs parameter (checked when the config was read)."""
        return None if self.json_schema is None else {"json": json.loads(Path(self.json_schema).read_text())}

    @field_validator("json_schema")
    @classmethod
    def _json_schema(cls, v: str | None) -> str | None:
        if v is None:
            return v
        from dstool.decoding.grammar import GrammarError, grammar_of  # noqa: PLC0415 (numpy: the CLI's parser imports this module)

        try:
            schema = json.loads(Path(v).read_text())
        except OSError as e:
            raise ValueError(f"--json-schema {v}: cannot read it ({e.strerror})") from None
        except ValueError as e:
            raise ValueError(f"--json-schema {v}: not JSON ({e})") from None
        try:
            grammar_of({"json": schema})
        except GrammarError as e:
            raise ValueError(f"--json-schema {v}: {str(e).split(': ', 1)[-1]}") from None
        return v

    def sampling(self) -> dict:
        """The options given, as the models' request parameters."""
        names = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "seed")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @model_validator(mode="after")
    def _engines_rule(self) -> SamplingOptions:
        """What the models would refuse is refused here, by their own rule (one message, before any work)."""
        from dstool.decoding.sampling import SamplingError, SamplingParams  # noqa: PLC0415 (numpy: the CLI's parser imports this module)

        try:
            SamplingParams.from_parameters(self.sampling())
        except SamplingError as e:
            name, _, rest = str(e).partition(" ")
            raise ValueError(f"--{name.replace('_', '-')} {rest}") from None
        return self


class ClientOptions(SamplingOptions):
    """What a client of a served model sends besides its request: the gateway's credentials."""

    api_key: str | None = Field(None, description="the gateway's API key (from `dstool keys create`, or its "
                                "--token-file token); default $DSTOOL_API_KEY, else $DSTOOL_GATEWAY_TOKEN (a flag "
                                "shows in process lists: prefer the variable)", json_schema_extra={
                                    "cli": {"metavar": "KEY"}, "secret": True})

    def credentials(self) -> dict[str, str]:
        """The Authorization header to send, if a key is given."""
        key = self.api_key or os.environ.get("DSTOOL_API_KEY") or os.environ.get("DSTOOL_GATEWAY_TOKEN")
        return {"authorization": f"Bearer {key}"} if key else {}


class InferConfig(ClientOptions):
    """`dstool infer`: text through MODEL_generate, or token ids through the tensor model, with tritonclient."""

    prompt: str | None = positional("text to continue", default=None)
    ids: str | None = Field(None, description="comma-separated token ids for the tensor model (instead of PROMPT)")
    max_new_tokens: int | None = Field(None, ge=1, le=2**31 - 1, description="tokens to generate (default: the "
                                       "model's, 32; "
                                       "with --openai, OpenAI's 16)")
    kv_cache: bool = Field(True, description="decode with the key/value cache")
    url: str | None = Field(None, description="HOST:PORT (default: 127.0.0.1:8000 for http, :8001 for grpc)")
    protocol: Literal["http", "grpc"] = "http"
    model: str = Field("dstool_lm", description="the model family's name in the repository")
    stream: bool = Field(False, description="print the text token by token as MODEL_llm generates it")
    openai: bool = Field(False, description="ask the gateway's OpenAI route (/v1/completions; HTTP port)")
    edge: str | None = Field(None, description="generate here, with onnxruntime, from this edge package (dstool "
                             "export --target edge) instead of a server; prints the peak memory and tokens/s",
                             json_schema_extra={"cli": {"metavar": "PACKAGE"}})
    memory_cap_mb: float | None = Field(None, gt=0, description="--edge: the most resident memory the package may "
                                        "add to the process; blocks that do not fit stay closed until needed "
                                        "(default: no cap, every block stays open)",
                                        json_schema_extra={"cli": {"metavar": "MB"}})

    @field_validator("ids")
    @classmethod
    def _ids(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"\s*\d+\s*(,\s*\d+\s*)*,?\s*", v):
            raise ValueError(f"--ids takes comma-separated token ids, got '{v}'")
        return v

    @model_validator(mode="after")
    def _one_input(self) -> InferConfig:
        if (self.prompt is None) == (self.ids is None):
            raise ValueError("give a PROMPT to generate from, or --ids for the tensor model (one of the two)")
        if self.ids is not None and (self.stream or self.openai or self.sampling() or self.json_schema):
            raise ValueError("--stream, --openai, --json-schema and sampling options generate text: give a PROMPT, "
                             "not --ids")
        if self.json_schema and not self.kv_cache:
            raise ValueError("--json-schema is enforced by MODEL_llm, which always decodes with the key/value cache: "
                             "drop --no-kv-cache")
        if self.openai and self.protocol != "http":
            raise ValueError("--openai speaks HTTP to the gateway: drop --protocol grpc")
        if self.edge is None and self.memory_cap_mb is not None:
            raise ValueError("--memory-cap-mb applies to --edge only")
        server = sorted(self.model_fields_set & {"ids", "url", "protocol", "model", "stream", "openai", "kv_cache",
                                                 "api_key"})
        if self.edge is not None and server:
            raise ValueError(f"--{server[0].replace('_', '-')} is for a served model: --edge generates from the "
                             "package here (drop it)")
        return self

    def token_ids(self) -> list[int]:
        return [int(x) for x in (self.ids or "").split(",") if x.strip()]

    @property
    def address(self) -> str:
        return self.url or ("127.0.0.1:8001" if self.protocol == "grpc" else "127.0.0.1:8000")


class BatchConfig(ClientOptions):
    """`dstool batch`: offline generation or scoring over a data set on Apache Spark."""

    input: str = positional("jsonl, parquet or csv file (or a folder of them) of prompts; default: 1,000 prompts "
                            "from the embedded corpus's held-out tail", default="embedded:heldout-prompts",
                            metavar="INPUT")
    output: str = Field("runs/batch", description="output folder: rows/ (one file per partition), failures.jsonl, "
                        "dstool.json")
    repository: str = Field("model_repository", description="the model repository (from dstool export): its "
                            "manifest says which version made the results")
    model: str = Field("dstool_lm", description="the model family's name in the repository")
    version: int | None = Field(None, ge=1, description="the deployed version to use (default: the newest)")
    task: Literal["generate", "score"] = Field("generate", description="generate: new text after each prompt; "
                                               "score: each text's log-likelihood and perplexity")
    engine: Literal["onnx", "triton"] = Field("onnx", description="onnx: ONNX Runtime inside each executor on the "
                                              "repository's graphs; triton: a running Triton or dstool gateway "
                                              "(--url), so online and offline traffic share its cache")
    url: str = Field("127.0.0.1:8001", description="--engine triton: the gRPC HOST:PORT of Triton or the gateway")
    column: str = Field("prompt", description="the input column of text")
    ids_column: str | None = Field(None, description="an input column of token-id lists to use instead of text "
                                   "(--engine onnx)")
    schema_column: str | None = Field(None, description="an input column of JSON schemas (JSON text), one per row, "
                                      "each row's answer following its own (an empty cell: --json-schema's, or "
                                      "none); --engine onnx")
    max_new_tokens: int | None = Field(None, ge=1, le=2**31 - 1, description="tokens to generate per row (default: "
                                       "the model's)")
    master: str | None = Field(None, description="Spark master: local[N], spark://HOST:7077, k8s://..., yarn "
                               "(default: local[2], or spark-submit's)")
    partitions: int | None = Field(None, ge=1, description="output partitions, each resumable on its own "
                                   "(default: one per 128 rows, at least 2)")
    max_batch: int = Field(16, ge=1, description="--engine onnx: rows decoded together per step in a task")
    concurrency: int = Field(16, ge=1, description="--engine triton: requests in flight per task")
    max_rows: int | None = Field(None, ge=1, description="use the first N rows of the input only")
    format: Literal["parquet", "jsonl"] = Field("parquet", description="output file format")
    on_error: Literal["fail", "record"] = Field("fail", description="a row that cannot run (a prompt too long for "
                                                "the model, an empty one): fail the job with one line, or record "
                                                "it in failures.jsonl and go on")
    overwrite: bool = Field(False, description="discard an output folder that holds another job's results")
    spark_conf: dict[str, str] = Field(default_factory=dict, description="extra Spark settings KEY=VALUE (repeat)",
                                       json_schema_extra={"cli": {"flag": "--conf", "metavar": "KEY=VALUE"}})

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return host_port(v)

    @model_validator(mode="after")
    def _choices(self) -> BatchConfig:
        if self.ids_column is not None and self.engine == "triton":
            raise ValueError("--ids-column needs --engine onnx (the served generation model takes text): give a text "
                             "--column or --engine onnx")
        if self.task == "score" and (self.sampling() or self.max_new_tokens is not None or self.json_schema or
                                     self.schema_column):
            raise ValueError("--task score reads the texts as they are: drop the sampling, --json-schema, "
                             "--schema-column and --max-new-tokens options")
        if self.api_key is not None and self.engine != "triton":
            raise ValueError("--api-key is for a served model (--engine triton): ONNX Runtime runs in the executors")
        if (self.json_schema or self.schema_column) and self.engine == "triton":
            raise ValueError("--json-schema and --schema-column need --engine onnx (the grammar runs in each "
                             "executor's sampler; the served generate model enforces none)")
        return self
